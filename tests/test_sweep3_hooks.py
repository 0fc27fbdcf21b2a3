"""The user's hooks and penalties of issue 39 ("never silently wrong, part three"), every step checked
against a one-sample-at-a-time autograd loop on a copy of the model (its forward hooks included), in
float64, on both sides of 16 positions per sample (weights run detached from the second step where a
transform covers them; the fused paths switch at 16 positions), with ``clip_norm`` at the median
per-sample norm and ``keep_grad_sample`` both ways:

- a forward hook that rescales a layer's output (a schedule, stochastic depth) is an op of the model
  after the layer: exact;
- a penalty on the input's gradient (lazy R1, WGAN-GP) is refused where pergrad computes per-sample
  gradients, before anything is written; the route the message gives is exact;
- a gradient-logging ``register_hook`` on the parameters leaves a late regulariser refused;
- a ``register_hook`` that changes a transformed parameter's gradient is refused naming the hook; one on
  an untransformed parameter goes into ``.grad`` as in plain PyTorch;
- freezing a layer after a scaling forward hook wraps again, exactly;
- a second wrapper sharing a weight with one not removed is refused, naming the other.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from pergrad import HookStateError, PergradError, PerSampleModule, SecondOrderError, transforms
from pergrad._core.capture.hooks import owners
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


# -- a penalty on the input's gradient ------------------------------------------------------------------

LAM = 0.3


def r1_penalised(penalised: Callable[[int], bool]) -> Losses:
    """Each sample's loss, plus ``LAM ||d out_i.sum() / d x_i||^2`` on the steps ``penalised`` says."""

    def losses(m: nn.Module, x: Tensor, y: Tensor, step: int, rows: slice) -> Tensor:
        x = x.clone().requires_grad_(True)
        out = m(x)
        f = (out - y).pow(2).flatten(1).sum(1)
        if penalised(step):
            (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            f = f + LAM * g.pow(2).flatten(1).sum(1)
        return f

    return losses


@pytest.mark.parametrize(("keep", "clip"), [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("first", [0, 1])
def test_a_penalty_on_the_input_gradient_is_refused_before_anything_is_written(
    keep: bool, clip: bool, first: int
) -> None:
    """Lazy R1 from step ``first`` on, every other step: the steps before are exact; the penalised one
    is refused as its backward starts, naming the cause, the layer and the route that works, and no
    .grad got anything from it (with nothing per sample: ``test_a_penalty_with_nothing_per_sample_is_autograds``)."""
    torch.manual_seed(2)
    model = Net()
    losses = r1_penalised(lambda step: step >= first and (step - first) % 2 == 0)
    psm = PerSampleModule(model, keep_grad_sample=keep, detach_transformed=False)
    steps = STEPS[: first + 1]
    with pytest.raises(
        SecondOrderError,
        match=r"differentiates a gradient that torch\.autograd\.grad\(\.\.\., create_graph=True\) computed through "
        r"layer '(fc1|norm|fc2)' \((Linear|LayerNorm)\) \(a gradient penalty.*accumulates into parameter '.*', whose "
        r"per-sample gradients pergrad computes.*through the layers' backward computations.*"
        r"torch\.autograd\.grad\(penalty, params, allow_unused=True\)",
    ):
        original = STEPS[:]
        STEPS[:] = steps
        try:
            run_steps(model, losses, keep=keep, clip=clip, psm=psm)
        finally:
            STEPS[:] = original
    assert all(p.grad is None for p in model.parameters())  # zero_grad() before the refused backward
    assert not owners(model)


@pytest.mark.parametrize("keep", [True, False])
def test_with_weights_detached_the_input_gradient_is_refused_naming_autograd_grad(keep: bool) -> None:
    """The default: from the second step the weights run detached, so the input's gradient could not be
    differentiated through them; the error names ``torch.autograd.grad``, and its fix leads to the
    refusal above, whose route is exact (``test_the_penalty_taken_outside_pergrad_is_exact``)."""
    torch.manual_seed(3)
    model = Net()
    original = STEPS[:]
    STEPS[:] = [(4, 20), (3, 17)]
    try:
        with pytest.raises(
            SecondOrderError,
            match=r"torch\.autograd\.grad\(create_graph=True\) reached layer '(fc1|norm|fc2)'.*its weight detached.*"
            r"the gradient it returns \(of the model's input, for a gradient penalty\) could not be differentiated "
            r"through that weight.*detach_transformed=False",
        ):
            run_steps(model, r1_penalised(lambda step: step == 1), keep=keep, clip=True)
    finally:
        STEPS[:] = original


@pytest.mark.parametrize("keep", [True, False])
def test_the_penalty_taken_outside_pergrad_is_exact(keep: bool) -> None:
    """The route the refusal gives: the loss's backward through pergrad (per sample, clipped), the
    penalty's gradient from torch.autograd.grad, added to .grad: on every step,
    ``(1/B) sum_i clip(g_i) + LAM d mean_i ||d out_i / d x_i||^2``, and ``grad_sample`` the loss's."""
    torch.manual_seed(4)
    model = Net()
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(0)
    clipper = transforms.clip_norm(1.0)
    with PerSampleModule(model, keep_grad_sample=keep, detach_transformed=False) as psm:
        psm.register_transform(model, clipper)
        for step, (b, t) in enumerate(STEPS):
            x, y = batch(b, t, gen)
            ref = reference(model, squared, x, y, step)
            clipper.max_norm = median_norm(ref)
            plain = copy.deepcopy(model)
            xr = x.clone().requires_grad_(True)
            (gr,) = torch.autograd.grad(plain(xr).sum(), xr, create_graph=True)
            penalty_ref = [
                torch.zeros_like(p) if g is None else g
                for p, g in zip(
                    plain.parameters(),
                    torch.autograd.grad(
                        LAM * gr.pow(2).flatten(1).sum(1).mean(), list(plain.parameters()), allow_unused=True
                    ),
                )
            ]
            psm.zero_grad()
            x = x.clone().requires_grad_(True)
            out = psm(x)
            (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            penalty = LAM * g.pow(2).flatten(1).sum(1).mean()
            (out - y).pow(2).flatten(1).sum(1).mean().backward(retain_graph=True)
            for p, extra in zip(params, torch.autograd.grad(penalty, params, allow_unused=True)):
                if extra is not None:
                    p.grad += extra  # type: ignore[operator]
            expected = clipped_mean(ref, clipper.max_norm)
            for (name, p), pen in zip(model.named_parameters(), penalty_ref):
                assert_close(p.grad, expected[name] + pen, f"step {step}: .grad of {name}")
                if keep:
                    assert_close(p.grad_sample, ref[name], f"step {step}: grad_sample of {name}")


def test_a_penalty_with_nothing_per_sample_is_autograds() -> None:
    """No grad_sample, no transform, no norms: pergrad computes nothing per sample, so the penalised
    backward is autograd's own, exact on every step."""
    torch.manual_seed(5)
    run_steps(Net(), r1_penalised(lambda step: step % 2 == 1), keep=False, clip=False, detach=False)


class Tower(nn.Module):
    """``Net``'s layers, returning the output and the intermediate tensors a penalty may differentiate
    by: ``x``, the top layer's input ``top`` (the top layer's output gradient is the constant gradient
    of ``out.sum()``: only its input's gradient carries the layer's weight) and ``mid`` (fc1's output,
    so norm and fc2 are between it and the output)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 6)
        self.norm = nn.LayerNorm(6)
        self.fc2 = nn.Linear(6, OUTPUTS)

    def forward(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        mid = self.fc1(x)
        top = torch.tanh(self.norm(mid))
        return self.fc2(top), {"x": x, "mid": mid, "top": top}


class OneLayer(nn.Module):
    """A single Linear (the only layer is the top one), with the input a penalty differentiates by."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(FEATURES, OUTPUTS)

    def forward(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return self.fc(x), {"x": x}


class Attention(nn.Module):
    """Self-attention on the input (a rule that takes every input: query, key and value), then a Linear.
    (``need_weights=True``: the fused kernel of ``need_weights=False`` has no double backward on CPU.)"""

    sequences_only = True

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(FEATURES, 1, batch_first=True)
        self.fc = nn.Linear(FEATURES, OUTPUTS)

    def forward(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        mixed, _ = self.attn(x, x, x)
        return self.fc(torch.tanh(mixed)), {"x": x, "mixed": mixed}


def output(m: nn.Module, x: Tensor) -> Tensor:
    out, _ = m(x)
    return out


PENALISED = {  # model, the tensor the penalty differentiates by, the layers the refusal may name, frozen
    "one layer": (OneLayer, "x", "fc", ()),
    "the top layer's input": (Tower, "top", "fc2", ()),
    "an intermediate tensor": (Tower, "mid", "(norm|fc2)", ()),
    "the input, the lower layers frozen": (Tower, "x", "fc2", ("fc1", "norm")),
    "attention's inputs, the Linear frozen": (Attention, "x", "attn", ("fc",)),
}


@pytest.mark.parametrize("case", list(PENALISED))
@pytest.mark.parametrize(
    "tracked", ["grad_sample", "norms", "clip", "grad_sample and clip, weights run detached", "norms, sequence first"]
)
def test_a_penalty_whose_layer_output_gradient_carries_no_graph_is_refused_on_every_step(
    case: str, tracked: str
) -> None:
    """Lazy R1 on the odd steps, with ``torch.autograd.grad(out.sum(), t, create_graph=True)`` of a tensor
    ``t`` whose gradient reaches a layer's weight only through that layer's input gradient (``d_input =
    d_output @ W`` with ``d_output`` the constant gradient of ``out.sum()``: a one-layer model, the top
    layer, layers whose output gradient depends on no trainable parameter). Each penalised backward is
    refused as it starts, naming the penalty, before anything is written; every other step is exact (the
    refused one left nothing behind). Where the weights run detached (the default, from the second step),
    ``torch.autograd.grad`` is refused already. ``batch_first=False`` catches the gradient of the layer's
    input as the model passed it (pergrad's rule reads a view with the batch first)."""
    torch.manual_seed(7)
    make, by, named, frozen = PENALISED[case]
    model = make()
    for name in frozen:
        model.get_submodule(name).requires_grad_(False)
    keep, clip = tracked.startswith("grad_sample"), "clip" in tracked
    detach, first = "detached" in tracked, "sequence first" not in tracked
    if isinstance(model, Attention):
        model.attn.batch_first = first  # (read at each call)
    psm = PerSampleModule(
        model, keep_grad_sample=keep, track_norms="norms" in tracked, detach_transformed=detach, batch_first=first
    )
    clipper = transforms.clip_norm(1.0)
    if clip:
        psm.register_transform(model, clipper)
    gen = torch.Generator().manual_seed(0)

    def turn(t: Tensor) -> Tensor:  # the model's layout from the batch-first one
        return t if first or t.dim() == 2 else t.transpose(0, 1)

    def losses(m: nn.Module, x: Tensor, y: Tensor, step: int, rows: slice) -> Tensor:
        return (turn(output(m, turn(x))) - y).pow(2).flatten(1).sum(1)

    penalty = (
        r"differentiates a gradient that torch\.autograd\.grad\(\.\.\., create_graph=True\) computed through "
        rf"layer '{named}' \((Linear|LayerNorm|MultiheadAttention)\) \(a gradient penalty.*accumulates into parameter '.*', whose per-sample "
        r"gradients pergrad computes"
    )
    sequences = not first or getattr(model, "sequences_only", False)
    steps = [(b, t) for b, t in STEPS if t > 1] if sequences else STEPS
    with psm:
        for step, (b, t) in enumerate(steps):
            x, y = batch(b, t, gen)
            psm.zero_grad()
            if step % 2 == 1:
                # with weights run detached (from the second step), torch.autograd.grad is refused; pergrad
                # stops detaching after it, and the penalty is refused from then on
                detached = detach and step == 1 and not isinstance(model, Attention)  # (attention: never detached)
                with pytest.raises(SecondOrderError) as refused:
                    xg = turn(x).clone().requires_grad_(True)
                    out, at = model(xg)
                    (g,) = torch.autograd.grad(out.sum(), at[by], create_graph=True)
                    assert not detached, f"step {step}: torch.autograd.grad was not refused"
                    loss = (turn(out) - y).pow(2).flatten(1).sum(1).mean() + LAM * g.pow(2).sum()
                    loss.backward()
                refused.match(r"torch\.autograd\.grad\(create_graph=True\) reached.*detached" if detached else penalty)
                assert all(p.grad is None for p in model.parameters()), f"step {step}"
                continue
            ref = reference(model, losses, x, y, step)
            clipper.max_norm = median_norm(ref)
            expected = clipped_mean(ref, clipper.max_norm) if clip else {n: g.mean(0) for n, g in ref.items()}
            losses(model, x, y, step, slice(0, b)).mean().backward()
            norms = psm.per_sample_norms() if "norms" in tracked else {}
            for name, p in model.named_parameters():
                what = f"step {step} (B={b}, T={t}): {name}"
                if not p.requires_grad:
                    assert p.grad is None, what
                    continue
                assert_close(p.grad, expected[name], f".grad of {what}")
                if keep:
                    assert_close(p.grad_sample, ref[name], f"grad_sample of {what}")
                if norms:
                    assert_close(norms[name], ref[name].flatten(1).norm(dim=1), f"norm of {what}")


@pytest.mark.parametrize("replaced", [False, True])
def test_a_penalty_on_a_single_linear_after_its_parameters_are_replaced_names_the_penalty(replaced: bool) -> None:
    """The fuzzer's case: one Linear, norms tracked, a step, then (``replaced``) ``load_state_dict(assign=True)``
    (new parameters, hooked again at the next backward, whose first backward's check then runs), then R1:
    refused as the backward starts with the cause, not by the check as a part no layer produced."""
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(3, 2))
    psm = PerSampleModule(model, track_norms=True, accumulate="samples")
    x, y = torch.randn(2, 3), torch.randn(2, 2)
    with psm:
        (psm(x) - y).pow(2).sum(1).mean().backward()
        if replaced:
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        psm.zero_grad()
        xg = x.clone().requires_grad_(True)
        out = psm(xg)
        (g,) = torch.autograd.grad(out.sum(), xg, create_graph=True)
        with pytest.raises(SecondOrderError, match=r"computed through layer '0' \(Linear\) \(a gradient penalty"):
            ((out - y).pow(2).sum(1).mean() + LAM * g.square().sum()).backward()
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("make", [OneLayer, Tower])
@pytest.mark.parametrize(("keep", "clip"), [(True, True), (True, False), (False, True)])
def test_a_penalty_on_the_input_grad_after_a_create_graph_backward_is_autograds(
    make: Callable[[], nn.Module], keep: bool, clip: bool
) -> None:
    """``loss.backward(create_graph=True)``, then a penalty on ``x.grad`` backwarded: as for any backward
    through a ``create_graph=True`` backward's result, pergrad stays out of the penalty's backward, also
    where no layer's output gradient carries a graph (a one-layer model): ``.grad`` is the loss's
    reduction plus autograd's gradient of the penalty, ``grad_sample`` the loss's, on every step."""
    torch.manual_seed(8)
    model = make()
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(0)
    clipper = transforms.clip_norm(1.0)

    def losses(m: nn.Module, x: Tensor, y: Tensor, step: int, rows: slice) -> Tensor:
        return (output(m, x) - y).pow(2).flatten(1).sum(1)

    with PerSampleModule(model, keep_grad_sample=keep) as psm:
        if clip:
            psm.register_transform(model, clipper)
        for step, (b, t) in enumerate(STEPS):
            x, y = batch(b, t, gen)
            ref = reference(model, losses, x, y, step)
            clipper.max_norm = median_norm(ref)
            plain = copy.deepcopy(model)
            xr = x.clone().requires_grad_(True)
            (gr,) = torch.autograd.grad(losses(plain, xr, y, step, slice(0, b)).mean(), xr, create_graph=True)
            penalty_ref = torch.autograd.grad(LAM * gr.pow(2).sum(), list(plain.parameters()))
            psm.zero_grad()
            x = x.clone().requires_grad_(True)
            losses(model, x, y, step, slice(0, b)).mean().backward(create_graph=True)
            assert x.grad is not None
            (LAM * x.grad.pow(2).sum()).backward()
            expected = clipped_mean(ref, clipper.max_norm) if clip else {n: g.mean(0) for n, g in ref.items()}
            for (name, p), pen in zip(model.named_parameters(), penalty_ref):
                what = f"step {step} (B={b}, T={t}): {name}"
                assert_close(p.grad, expected[name] + pen, f".grad of {what}")
                if keep:
                    assert_close(p.grad_sample, ref[name], f"grad_sample of {what}")
            assert params


# -- tensor hooks on the parameters ---------------------------------------------------------------------


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("detach", [True, False])
@pytest.mark.parametrize("on", ["norm.weight", "fc1.weight"])
def test_a_late_regulariser_is_refused_when_the_parameters_carry_a_logging_hook(
    keep: bool, detach: bool, on: str
) -> None:
    """``p.register_hook(log)`` on every parameter (as wandb.watch adds): the hooks get autograd's
    gradient of the batch, the steps are exact, and a regulariser that starts at step 2 is refused on
    that step, as without the hooks."""
    torch.manual_seed(6)
    model = Net()
    logged: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: logged.__setitem__(name, g.clone()))

    def losses(m: nn.Module, x: Tensor, y: Tensor, step: int, rows: slice) -> Tensor:
        f = squared(m, x, y, step, rows)
        return f + 1e-2 * m.get_parameter(on).square().sum() if step >= 2 else f

    def after(step: int, ref: dict[str, Tensor]) -> None:
        for name in ref:  # the hooks got autograd's gradient of the batch (unclipped)
            assert_close(logged.pop(name), ref[name].mean(0), f"step {step}: what the hook of {name} got")

    with pytest.raises(HookStateError, match=rf"parameter '{on}': its gradient has a part that no hooked layer"):
        run_steps(model, losses, keep=keep, clip=True, detach=detach, after=after)
    assert not owners(model)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("when", [0, 2])
def test_a_hook_that_changes_a_transformed_gradient_is_refused_naming_the_hook(keep: bool, when: int) -> None:
    """``p.register_hook(lambda g: g * 0.5)`` on a parameter a transform covers, from the first step or a
    later one: pergrad writes its .grad from the clipped per-sample gradients, so the hook's change
    would be dropped. Refused on the step it appears, with the real cause (not "a regulariser")."""
    torch.manual_seed(7)
    model = Net()

    def before(step: int) -> None:
        if step == when:
            model.fc1.weight.register_hook(lambda g: g * 0.5)

    with pytest.raises(
        HookStateError,
        match=r"parameter 'fc1\.weight': a hook registered on it with register_hook returned a gradient other than "
        r"the one autograd gave it, but a transform covers this parameter.*register_post_accumulate_grad_hook",
    ) as refused:
        run_steps(model, squared, keep=keep, clip=True, before=before)
    assert "regulariser" not in str(refused.value)


@pytest.mark.parametrize("keep", [True, False])
def test_the_fix_a_post_accumulate_grad_hook_changes_the_written_grad(keep: bool) -> None:
    """What the refusal suggests: a post-accumulate-grad hook halves the clipped .grad pergrad wrote."""
    torch.manual_seed(8)
    model = Net()
    model.fc1.weight.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(0.5))  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(0)
    clipper = transforms.clip_norm(1.0)
    with PerSampleModule(model, keep_grad_sample=keep) as psm:
        psm.register_transform(model, clipper)
        for step, (b, t) in enumerate(STEPS):
            x, y = batch(b, t, gen)
            ref = reference(model, squared, x, y, step)
            clipper.max_norm = median_norm(ref)
            expected = clipped_mean(ref, clipper.max_norm)
            psm.zero_grad()
            squared(psm.module, x, y, step, slice(0, b)).mean().backward()
            for name, p in model.named_parameters():
                half = 0.5 if name == "fc1.weight" else 1.0
                assert_close(p.grad, half * expected[name], f"step {step}: .grad of {name}")


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("when", [0, 2])
def test_a_hook_that_changes_an_untransformed_gradient_goes_into_grad_as_in_pytorch(keep: bool, when: int) -> None:
    """No transform covers ``fc1.weight``: autograd writes its .grad, with what the hook returned (as
    without pergrad); ``grad_sample``, the norms and the statistics are the samples' own gradients, and
    the first backward's check compares them with autograd's gradient before the hook."""
    torch.manual_seed(9)
    model = Net()
    gen = torch.Generator().manual_seed(0)
    with PerSampleModule(model, keep_grad_sample=keep, track_statistics=["mean"]) as psm:
        for step, (b, t) in enumerate(STEPS):
            if step == when:
                model.fc1.weight.register_hook(lambda g: g * 0.5)
            x, y = batch(b, t, gen)
            ref = reference(model, squared, x, y, step)
            psm.zero_grad()
            squared(psm.module, x, y, step, slice(0, b)).mean().backward()
            norms, stats = psm.per_sample_norms(), psm.statistics()
            for name, p in model.named_parameters():
                half = 0.5 if name == "fc1.weight" and step >= when else 1.0
                assert_close(p.grad, half * ref[name].mean(0), f"step {step}: .grad of {name}")
                assert_close(norms[name], ref[name].flatten(1).norm(dim=1), f"step {step}: norms of {name}")
                assert_close(stats.params[name].mean, ref[name].mean(0), f"step {step}: mean of {name}")
                if keep:
                    assert_close(p.grad_sample, ref[name], f"step {step}: grad_sample of {name}")


def test_pergrads_own_tensor_hook_goes_with_the_wrapper() -> None:
    """pergrad's hook is first among the user's while wrapped, and gone after remove(): the user's hooks
    stay, in their order, and their handles still remove them."""
    torch.manual_seed(10)
    model = Net()
    calls: list[str] = []
    first = model.fc1.weight.register_hook(lambda g: calls.append("first"))
    model.fc1.weight.register_hook(lambda g: calls.append("second"))
    before = list(model.fc1.weight._backward_hooks.values())  # type: ignore[union-attr]
    with PerSampleModule(model) as psm:
        x, y = batch(3, 1, torch.Generator().manual_seed(0))
        squared(psm.module, x, y, 0, slice(0, 3)).mean().backward()
        assert len(model.fc1.weight._backward_hooks) == 3  # type: ignore[arg-type]
    assert list(model.fc1.weight._backward_hooks.values()) == before  # type: ignore[union-attr]
    assert calls == ["first", "second"]
    first.remove()
    model.zero_grad()
    squared(model, x, y, 0, slice(0, 3)).mean().backward()
    assert calls == ["first", "second", "second"]


# -- two wrappers sharing a weight -----------------------------------------------------------------------


def test_a_second_wrapper_sharing_a_weight_is_refused_naming_the_other() -> None:
    """``b.weight = a.weight``, ``PerSampleModule(a)`` then ``PerSampleModule(b)``: refused at the second
    wrap, naming the other wrapper, its model and the parameter's name there; ``b`` is left as it was.
    The fix the message gives (one wrapper over both, called as before) is exact on every step."""
    torch.manual_seed(11)
    a, b = nn.Linear(FEATURES, FEATURES), nn.Linear(FEATURES, FEATURES)
    b.weight = a.weight
    first = PerSampleModule(a)
    with pytest.raises(
        PergradError,
        match=r"parameter 'weight' of this Linear is also parameter 'weight' of the Linear wrapped by another "
        r"PerSampleModule \(PerSampleModule\(Linear, .*\)\), which has not been removed.*Call \.remove\(\) on the "
        r"other wrapper and wrap one module that holds both models",
    ):
        PerSampleModule(b)
    assert not owners(b)
    first.remove()
    PerSampleModule(b).remove()  # once the other is removed

    both = nn.ModuleList([a, b])

    def losses(m: nn.Module, x: Tensor, y: Tensor, step: int, rows: slice) -> Tensor:
        first, second = m  # a and b (in the reference, their copies)
        out = first(second(x)) if step % 2 else first(x) + second(x)  # the members called directly, as before
        return (out[..., :OUTPUTS] - y).pow(2).flatten(1).sum(1)

    for keep in (True, False):
        run_steps(both, losses, keep=keep, clip=True)

"""Adversarial tests of pergrad under ``torch.compile`` as users write it, above all a compiled training step
(forward, ``loss.backward()``, ``optimizer.step()`` in one compiled function): every step of each loop (batch
shapes that change: positions on both sides of 16, T == B, another batch size) checked in float64 against a
one-sample-at-a-time autograd loop on a copy of the model made before anything was compiled, or, where pergrad
refuses, against what eager pergrad does for the same code (the same numbers or the same error)."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pergrad import PerSampleModule, transforms
from pergrad.errors import HookStateError
from tests.reference import assert_close, clipped, clipped_mean
from tests.test_compile_order import (
    fresh,  # noqa: F401 -- autouse: a reset Dynamo and float64 for each test
    sgd_step,
)

BOUND = 0.5
LR = 0.5
SHAPES = [(4, 15), (4, 16), (4, 17), (4, 4), (3, 16), (5, 15)]  # both sides of 16, T == B, other batch sizes
Loss = Callable[[Tensor, Tensor], Tensor]


class Net(nn.Module):
    """A user's module: two linear layers over ``[B, T, 6]``, its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.inp(x)))


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.mean(1), y)


def batch(step: int) -> tuple[Tensor, Tensor]:
    b, t = SHAPES[step % len(SHAPES)]
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(b, t, 6, generator=g), torch.randint(0, 3, (b,), generator=g)


def one_at_a_time(model: nn.Module, x: Tensor, y: Tensor, loss: Loss = ce) -> dict[str, Tensor]:
    """``{name: [B, *shape]}``: each sample's gradient of its own loss, by autograd on ``model`` (the reference)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads: dict[str, list[Tensor]] = {n: [] for n in params}
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        loss(model(x[i : i + 1]), y[i : i + 1]).backward()  # (not autograd.grad: reentrant checkpointing refuses it)
        for n, p in params.items():
            assert p.grad is not None
            grads[n].append(p.grad.clone())
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(gs) for n, gs in grads.items()}


def wrapped(model: nn.Module | None = None, **options: Any) -> tuple[nn.Module, PerSampleModule, nn.Module]:
    """The model (a fresh ``Net`` unless given), its wrapper clipping the whole model at ``BOUND``, and the
    reference: a copy of the model made before anything is compiled."""
    if model is None:
        torch.manual_seed(0)
        model = Net()
    reference = copy.deepcopy(model)
    psm = PerSampleModule(model, **options)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    return model, psm, reference


def check(
    model: nn.Module,
    reference: nn.Module,
    run: Callable[[Tensor, Tensor], Any],
    steps: int = len(SHAPES),
    *,
    updated: bool = True,
    loss: Loss = ce,
    psm: PerSampleModule | None = None,
    grad_sample: bool = False,
) -> None:
    """``steps`` calls of ``run(x, y)``, each step's ``.grad`` (and ``p - LR * .grad`` where ``run`` updates the
    model; else the test applies that update) checked against the clipped mean of the reference's per-sample
    gradients; with ``grad_sample``, ``p.grad_sample`` and ``psm.per_sample_norms()`` too."""
    for k in range(steps):
        x, y = batch(k)
        per_sample = one_at_a_time(reference, x, y, loss)
        expected = clipped_mean(per_sample, BOUND)
        run(x, y)
        with torch.no_grad():
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                assert p.grad is not None, f"step {k}: no .grad of {name}"
                assert_close(p.grad, expected[name], f"step {k}: .grad of {name}")
                if grad_sample:
                    assert_close(p.grad_sample, per_sample[name], f"step {k}: grad_sample of {name}")
                if updated:
                    assert_close(p, q - LR * expected[name], f"step {k}: {name} after the step")
                else:
                    p.sub_(LR * p.grad)
                q.copy_(p)
            if grad_sample:
                assert psm is not None
                norms = psm.per_sample_norms()
                for name, g in per_sample.items():
                    assert_close(norms[name], g.flatten(1).norm(dim=1), f"step {k}: norm of {name}")


# -- a compiled training step: backends and options --------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"backend": "aot_eager", "dynamic": True},
        {"backend": "aot_eager", "fullgraph": False, "dynamic": False},
        {"backend": "eager"},
        {"backend": "inductor", "dynamic": True},
        {"mode": "max-autotune-no-cudagraphs"},
    ],
    ids=["aot_eager-dynamic", "aot_eager-static", "eager", "inductor-dynamic", "max-autotune-no-cudagraphs"],
)
def test_a_compiled_training_step_is_exact_on_every_step(options: dict[str, Any]) -> None:
    model, psm, reference = wrapped()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    check(model, reference, torch.compile(sgd_step(psm, optimizer), **options))


class Mixed(nn.Module):
    """Other rules than Linear's in one model: a 1-d convolution, a layer norm, an embedding of the positions
    (shared by the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv1d(6, 8, 3, padding=1), nn.LayerNorm(8)
        self.pos, self.out = nn.Embedding(32, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return self.out(torch.tanh(self.norm(h) + self.pos(torch.arange(x.shape[1]))))


def test_a_compiled_step_through_conv_norm_and_a_shared_embedding_is_exact_on_every_step() -> None:
    torch.manual_seed(0)
    model, psm, reference = wrapped(Mixed())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    @torch.compile(backend="aot_eager")
    def step(x: Tensor, y: Tensor) -> None:
        optimizer.zero_grad(set_to_none=False)  # zeros, not None, in .grad
        ce(psm(x), y).backward()
        optimizer.step()

    check(model, reference, step)


# -- compiled pieces inside a compiled step ------------------------------------------------------------------


def test_a_compiled_step_around_a_compiled_wrapper_is_exact_on_every_step() -> None:
    model, psm, reference = wrapped()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    check(
        model,
        reference,
        torch.compile(sgd_step(torch.compile(psm, backend="aot_eager"), optimizer), backend="aot_eager"),
    )


@pytest.mark.parametrize("compile_first", [True, False], ids=["compiled-then-wrapped", "wrapped-then-compiled"])
def test_a_compiled_step_around_a_model_compiled_in_place_is_exact_on_every_step(compile_first: bool) -> None:
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    if compile_first:
        model.compile(backend="aot_eager")
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    if not compile_first:
        model.compile(backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    check(model, reference, torch.compile(sgd_step(psm, optimizer), backend="aot_eager"))


class Trainer(nn.Module):
    """A user's module holding the wrapper and computing the loss: the module compiled, not the wrapper."""

    def __init__(self, psm: PerSampleModule) -> None:
        super().__init__()
        self.psm = psm

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return ce(self.psm(x), y)


@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward-outside", "backward-inside"])
def test_the_wrapper_inside_a_compiled_user_module_is_exact_on_every_step(backward_inside: bool) -> None:
    model, psm, reference = wrapped()
    trainer = torch.compile(Trainer(psm), backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def outside(x: Tensor, y: Tensor) -> None:
        optimizer.zero_grad()
        trainer(x, y).backward()
        optimizer.step()

    run = torch.compile(outside, backend="aot_eager") if backward_inside else outside
    check(model, reference, run)


# -- gradient accumulation and several backward passes -------------------------------------------------------


def test_micro_batches_backward_inside_one_compiled_step_sum_their_clipped_means() -> None:
    """Two micro-batches' backward in one compiled step: ``.grad`` is the sum of each one's clipped mean (as in
    eager: each backward adds its own reduction)."""
    model, psm, reference = wrapped()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    @torch.compile(backend="aot_eager")
    def step(x: Tensor, y: Tensor) -> None:
        optimizer.zero_grad()
        half = x.shape[0] // 2
        ce(psm(x[:half]), y[:half]).backward()
        ce(psm(x[half:]), y[half:]).backward()
        optimizer.step()

    for k in range(len(SHAPES)):
        x, y = batch(k)
        half = x.shape[0] // 2
        first = clipped_mean(one_at_a_time(reference, x[:half], y[:half]), BOUND)
        second = clipped_mean(one_at_a_time(reference, x[half:], y[half:]), BOUND)
        step(x, y)
        with torch.no_grad():
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                expected = first[name] + second[name]
                assert_close(p.grad, expected, f"step {k}: .grad of {name}")
                assert_close(p, q - LR * expected, f"step {k}: {name}")
                q.copy_(p)


def test_a_compiled_micro_step_with_the_optimizer_step_outside_is_exact_on_every_step() -> None:
    model, psm, reference = wrapped(loss_reduction="sum")

    @torch.compile(backend="aot_eager", dynamic=True)
    def micro(x: Tensor, y: Tensor) -> None:
        F.cross_entropy(psm(x).mean(1), y, reduction="sum").backward()

    def summed(out: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(out.mean(1), y, reduction="sum")

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for k in range(len(SHAPES)):
        x, y = batch(k)
        expected = {n: g.sum(0) for n, g in clipped(one_at_a_time(reference, x, y, summed), BOUND).items()}
        optimizer.zero_grad()
        for part in torch.arange(x.shape[0]).split(2):
            micro(x[part], y[part])
        optimizer.step()
        with torch.no_grad():
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                assert_close(q - LR * expected[name], p, f"step {k}: {name}")
                q.copy_(p)


def two_backwards(psm: PerSampleModule) -> Callable[[Tensor, Tensor], None]:
    def step(x: Tensor, y: Tensor) -> None:
        psm.zero_grad()
        value = ce(psm(x), y)
        value.backward(retain_graph=True)
        value.backward()

    return step


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, str] | None:
    """What ``fn(*args)`` raised (its type and message), None where it returned."""
    try:
        fn(*args)
    except Exception as err:  # what eager pergrad raises, compared with the compiled step's
        return type(err).__name__, str(err)
    return None


def test_retain_graph_then_a_second_backward_in_a_compiled_step_does_what_eager_does() -> None:
    """(With torch's donated buffers off, as its error asks of ``retain_graph=True`` in a compiled step, the
    plain model's own one included.)"""
    eager_model, eager_psm, _ = wrapped()
    model, psm, _ = wrapped()
    compiled = torch.compile(two_backwards(psm), backend="aot_eager")
    for k in range(len(SHAPES)):
        x, y = batch(k)
        expected = outcome(two_backwards(eager_psm), x, y)
        with torch._functorch.config.patch(donated_buffer=False):
            found = outcome(compiled, x, y)
        assert found == expected, f"step {k}"
        assert expected is not None  # eager refuses it (the test would not reach what it attacks otherwise)
        for (name, p), q in zip(model.named_parameters(), eager_model.parameters(), strict=True):
            if q.grad is None:
                assert p.grad is None, f"step {k}: {name}"
            else:
                assert_close(p.grad, q.grad, f"step {k}: .grad of {name}")


def test_psm_zero_grad_inside_a_compiled_step_is_exact_on_every_step() -> None:
    """``psm.zero_grad()`` (which drops every ``grad_sample``) called inside the compiled step."""
    model, psm, reference = wrapped()

    @torch.compile(backend="aot_eager")
    def step(x: Tensor, y: Tensor) -> None:
        psm.zero_grad()
        ce(psm(x), y).backward()

    check(model, reference, step, updated=False, psm=psm, grad_sample=True)


# -- checkpointing, regularisers, what is read after the step ------------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp, self.mid, self.out = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def block(self, h: Tensor) -> Tensor:
        return torch.tanh(self.mid(h))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(checkpoint(self.block, h, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_in_a_model_trained_by_a_compiled_step_is_exact_on_every_step(reentrant: bool) -> None:
    torch.manual_seed(0)
    model, psm, reference = wrapped(Checkpointed(reentrant))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    check(model, reference, torch.compile(sgd_step(psm, optimizer), backend="aot_eager"))


def regularised(model: Net, psm: PerSampleModule) -> Callable[[Tensor, Tensor], None]:
    def step(x: Tensor, y: Tensor) -> None:
        model.zero_grad()
        (ce(psm(x), y) + 0.1 * model.inp.weight.square().sum()).backward()

    return step


def test_a_regulariser_on_a_clipped_weight_in_a_compiled_step_does_what_eager_does() -> None:
    eager_model, eager_psm, _ = wrapped()
    model, psm, _ = wrapped()
    compiled = torch.compile(regularised(model, psm), backend="aot_eager")
    for k in range(4):
        x, y = batch(k)
        expected = outcome(regularised(eager_model, eager_psm), x, y)
        found = outcome(compiled, x, y)
        assert found == expected, f"step {k}"
        assert expected is not None  # eager refuses it (the test would not reach what it attacks otherwise)
        for (name, p), q in zip(model.named_parameters(), eager_model.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), f"step {k}: {name}"
            if q.grad is not None:
                assert_close(p.grad, q.grad, f"step {k}: .grad of {name}")


def test_grad_sample_and_norms_read_after_a_compiled_step_are_exact_on_every_step() -> None:
    model, psm, reference = wrapped(keep_grad_sample=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    check(model, reference, torch.compile(sgd_step(psm, optimizer), backend="aot_eager"), psm=psm, grad_sample=True)


def test_norms_read_inside_a_compiled_step_are_exact_on_every_step() -> None:
    model, psm, reference = wrapped(keep_grad_sample=False, track_norms=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    seen: list[dict[str, Tensor]] = []

    @torch.compile(backend="aot_eager")
    def step(x: Tensor, y: Tensor) -> None:
        optimizer.zero_grad()
        ce(psm(x), y).backward()
        seen.append({n: t * 1 for n, t in psm.per_sample_norms().items()})
        optimizer.step()

    for k in range(len(SHAPES)):
        x, y = batch(k)
        per_sample = one_at_a_time(reference, x, y)
        expected = clipped_mean(per_sample, BOUND)
        step(x, y)
        with torch.no_grad():
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                assert_close(seen[-1][name], per_sample[name].flatten(1).norm(dim=1), f"step {k}: norm of {name}")
                assert_close(p, q - LR * expected[name], f"step {k}: {name}")
                q.copy_(p)


# -- optimizers, precision ---------------------------------------------------------------------------------


def test_adam_stepped_inside_a_compiled_step_is_exact_on_every_step() -> None:
    model, psm, reference = wrapped()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    mirror = copy.deepcopy(reference)
    mirror_optimizer = torch.optim.Adam(mirror.parameters(), lr=0.01)
    step = torch.compile(sgd_step(psm, optimizer), backend="aot_eager")
    for k in range(len(SHAPES)):
        x, y = batch(k)
        expected = clipped_mean(one_at_a_time(mirror, x, y), BOUND)
        step(x, y)
        for (name, p), q in zip(model.named_parameters(), mirror.parameters(), strict=True):
            q.grad = expected[name]
            assert_close(p.grad, expected[name], f"step {k}: .grad of {name}")
        mirror_optimizer.step()
        for (name, p), q in zip(model.named_parameters(), mirror.parameters(), strict=True):
            assert_close(p, q, f"step {k}: {name}")


def autocast_step(psm: PerSampleModule) -> Callable[[Tensor, Tensor], None]:
    def step(x: Tensor, y: Tensor) -> None:
        psm.module.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value = ce(psm(x), y)
        value.backward()

    return step


def test_bfloat16_autocast_inside_a_compiled_step_gives_eager_pergrads_numbers() -> None:
    torch.set_default_dtype(torch.float32)
    eager_model, eager_psm, _ = wrapped()
    model, psm, _ = wrapped()
    compiled = torch.compile(autocast_step(psm), backend="aot_eager")
    for k in range(len(SHAPES)):
        x, y = batch(k)
        autocast_step(eager_psm)(x, y)
        compiled(x, y)
        with torch.no_grad():
            for (name, p), q in zip(model.named_parameters(), eager_model.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3, msg=f"step {k}: {name}")
                p.sub_(LR * q.grad)
                q.sub_(LR * q.grad)


def test_a_grad_scaler_inside_a_compiled_step_is_exact_on_every_step() -> None:
    model, psm, reference = wrapped()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    psm.grad_scaler = scaler

    @torch.compile(backend="aot_eager")
    def step(x: Tensor, y: Tensor) -> None:
        optimizer.zero_grad()
        scaler.scale(ce(psm(x), y)).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()

    check(model, reference, step)


# -- errors midway, resets, recompiles ---------------------------------------------------------------------


class Fails(torch.autograd.Function):
    """The identity, whose backward raises while ``armed``."""

    armed = False

    @staticmethod
    def forward(ctx: Any, h: Tensor) -> Tensor:
        return h.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        if Fails.armed:
            raise RuntimeError("a NaN check failed")
        return g


class Failing(Net):
    def forward(self, x: Tensor) -> Tensor:
        return self.out(Fails.apply(torch.tanh(self.inp(x))))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_micro_batch_whose_backward_failed_midway_adds_nothing_to_the_next_ones_grad(compiled: bool) -> None:
    """A micro-step whose backward an error of the user's stops midway (``out``'s ``AccumulateGrad`` ran, with
    autograd's own unclipped sum, ``inp``'s did not), skipped: the next micro-batch's backward, with no
    ``zero_grad`` between, leaves ``.grad`` the clipped mean of its own batch alone, on every step."""
    torch.manual_seed(0)
    model, psm, reference = wrapped(Failing())

    def micro(x: Tensor, y: Tensor) -> None:
        ce(psm(x), y).backward()

    run = torch.compile(micro, backend="aot_eager") if compiled else micro

    def skipping(x: Tensor, y: Tensor) -> None:
        psm.zero_grad()
        Fails.armed = True
        try:
            with pytest.raises(RuntimeError, match="a NaN check failed"):
                run(x.flip(0), y.flip(0))
        finally:
            Fails.armed = False
        run(x, y)

    check(model, reference, skipping, updated=False)


def test_an_error_raised_by_the_compiled_step_after_the_forward_leaves_no_grad_and_the_next_steps_exact() -> None:
    model, psm, reference = wrapped()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    @torch.compile(backend="aot_eager")
    def step(x: Tensor, y: Tensor, fail: bool = False) -> None:
        optimizer.zero_grad()
        value = ce(psm(x), y)
        if fail:
            raise FloatingPointError("loss is NaN")
        value.backward()
        optimizer.step()

    check(model, reference, step, steps=3)
    with pytest.raises(FloatingPointError):
        step(*batch(3), fail=True)
    assert all(p.grad is None for p in model.parameters())
    check(model, reference, step)


def test_dynamo_reset_between_compiled_steps_is_exact_on_every_step() -> None:
    model, psm, reference = wrapped()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    step = torch.compile(sgd_step(psm, optimizer), backend="aot_eager")

    def reset_then_step(x: Tensor, y: Tensor) -> None:
        torch._dynamo.reset()
        step(x, y)

    check(model, reference, reset_then_step)


def test_past_the_recompile_limit_the_compiled_step_is_exact_on_every_step() -> None:
    model, psm, reference = wrapped()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        check(model, reference, torch.compile(sgd_step(psm, optimizer), backend="aot_eager"), steps=2 * len(SHAPES))


def test_eval_steps_between_compiled_training_steps_are_exact_on_every_step() -> None:
    model, psm, reference = wrapped()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    train = torch.compile(sgd_step(psm, optimizer), backend="aot_eager")

    @torch.compile(backend="aot_eager")
    def evaluate(x: Tensor, y: Tensor) -> Tensor:
        with torch.no_grad():
            return ce(psm(x), y)

    def both(x: Tensor, y: Tensor) -> None:
        psm.eval()
        assert_close(evaluate(x, y), ce(reference(x), y), "evaluation")
        psm.train()
        train(x, y)

    check(model, reference, both)


# -- compiled autograd -------------------------------------------------------------------------------------

COMPILED_AUTOGRAD = r"runs under compiled autograd .*torch._dynamo.config.compiled_autograd.* Nothing was written"


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks", "fullgraph"])
def test_a_compiled_step_made_with_the_compiled_autograd_flag_on_is_refused_then_eager_steps_exact(
    fullgraph: bool,
) -> None:
    """``torch._dynamo.config.compiled_autograd = True`` before ``torch.compile(step)`` (as torch's docs set it):
    every call of the step runs under compiled autograd, which pergrad refuses, naming the flag."""
    model, psm, reference = wrapped()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with torch._dynamo.config.patch(compiled_autograd=True):
        step = torch.compile(sgd_step(psm, optimizer), backend="aot_eager", fullgraph=fullgraph)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(Exception) as err:
        step(*batch(0))
    if fullgraph:  # Dynamo refuses the step's graph breaks (``optimizer.zero_grad``, pergrad's hooks) as it traces
        assert err.type is torch._dynamo.exc.Unsupported
    else:
        assert err.type is HookStateError
        assert re.search(COMPILED_AUTOGRAD, str(err.value)), str(err.value)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    check(model, reference, sgd_step(psm, optimizer))


# -- lean forwards, DP-SGD ---------------------------------------------------------------------------------


def test_lean_forwards_in_a_compiled_step_are_exact_on_every_step() -> None:
    """``lean_forwards=True``: each kind of forward runs lean from its third call (twice round the shapes)."""
    model, psm, reference = wrapped(lean_forwards=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    leans: list[bool] = []
    step = torch.compile(sgd_step(psm, optimizer), backend="aot_eager")

    def noted(x: Tensor, y: Tensor) -> None:
        step(x, y)
        leans.append(psm._hooks.followed.lean)

    check(model, reference, noted, steps=3 * len(SHAPES))
    assert any(leans)


def dp_run(compiled: bool) -> tuple[list[list[Tensor]], int]:
    """Four DP-SGD steps (Poisson batches, seeded noise) of a fresh model, through a training step compiled or
    not: the parameters after each step, and the steps ``DPSGD`` counted."""
    from torch.utils.data import DataLoader, TensorDataset

    from pergrad.privacy import DPSGD, PoissonBatchSampler, collate_with_empty

    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(40, 16, 6, generator=g), torch.randint(0, 3, (40,), generator=g))
    sampler = PoissonBatchSampler(len(data), 0.1, steps=4, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=collate_with_empty(data))
    psm = PerSampleModule(model, keep_grad_sample=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    dp = DPSGD(
        psm, optimizer, sampler, max_grad_norm=BOUND, noise_multiplier=1.0, generator=torch.Generator().manual_seed(3)
    )
    step = sgd_step(psm, optimizer)
    if compiled:
        step = torch.compile(step, backend="aot_eager")
    after = []
    for x, y in loader:
        step(x, y)
        after.append([p.detach().clone() for p in model.parameters()])
    return after, dp.steps


def test_dp_sgd_through_a_compiled_step_gives_eager_dp_sgds_parameters_on_every_step() -> None:
    """The same draws and the same seeded noise: the compiled step's parameters are eager DP-SGD's (whose clipping
    ``tests/test_privacy.py`` checks), and every step is counted."""
    expected, counted = dp_run(compiled=False)
    found, steps = dp_run(compiled=True)
    assert counted == steps == len(expected) == len(found) == 4
    for k, (ps, qs) in enumerate(zip(found, expected, strict=True)):
        for p, q in zip(ps, qs, strict=True):
            assert_close(p, q, f"step {k}")

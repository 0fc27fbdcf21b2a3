"""torch.compile and wrapping in any order (issue 41).

Dynamo does not guard compiled code on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``):
code it compiled for a model of a class before pergrad hooked one (a plain copy, compiled to compare) runs
the wrapped model of that class without pergrad's hooks. pergrad then sees no forward, and the
backward is refused naming the compiler and the fixes, which these tests show exact on every step
against a one-sample-at-a-time autograd loop on a copy of the model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pergrad import PerSampleModule, transforms
from pergrad.errors import HookStateError

BOUND = 0.5
SHAPES = [(4, 15), (4, 16), (4, 17), (4, 4)]  # positions on both sides of 16, and T == B


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    torch._dynamo.reset()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
    torch._dynamo.reset()


class Net(nn.Sequential):
    """A torch container: Dynamo compiles its code once for every instance (a user's own module class
    with its own forward gets code of its own per instance, and shows no such reuse)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.mean(1), y)


def batch(step: int) -> tuple[Tensor, Tensor]:
    b, t = SHAPES[step % len(SHAPES)]
    g = torch.Generator().manual_seed(step)
    return torch.randn(b, t, 6, generator=g), torch.randint(0, 3, (b,), generator=g)


def clipped_mean(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """``(1/B) sum_i min(1, C / ||g_i||) g_i``, each ``g_i`` from its own one-sample backward."""
    per_sample = []
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        loss(model(x[i : i + 1]), y[i : i + 1]).backward()
        per_sample.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    out = {}
    for n in per_sample[0]:
        terms = []
        for g in per_sample:
            norm = torch.stack([v.square().sum() for v in g.values()]).sum().sqrt()
            terms.append(g[n] * (BOUND / norm).clamp(max=1))
        out[n] = torch.stack(terms).mean(0)
    return out


def sgd_step(
    psm: PerSampleModule, optimizer: torch.optim.Optimizer, loss: Callable[[Tensor, Tensor], Tensor] = loss
) -> Callable[[Tensor, Tensor], Tensor]:
    """The training step a user writes, uncompiled: zero the gradients, forward, backward, update."""

    def step(x: Tensor, y: Tensor) -> Tensor:
        optimizer.zero_grad()
        value = loss(psm(x), y)
        value.backward()
        optimizer.step()
        return value

    return step


def run_plain_compiled() -> None:
    """A plain copy of the model class compiled and trained one step: Dynamo caches its code."""
    torch.manual_seed(1)
    plain = Net()
    x, y = batch(0)
    loss(torch.compile(plain, backend="aot_eager")(x), y).backward()


def train(
    model: nn.Module,
    psm: PerSampleModule,
    forward: Callable[[Tensor], Tensor],
    steps: int = 4,
    reference: nn.Module | None = None,
) -> None:
    """``steps`` SGD steps of the compiled wrapped model, each ``.grad`` checked against the reference (a copy of
    ``model`` made now, unless one made before it was compiled is given)."""
    reference = copy.deepcopy(model) if reference is None else reference
    for step in range(steps):
        x, y = batch(step)
        expected = clipped_mean(reference, x, y)
        psm.zero_grad()
        loss(forward(x), y).backward()
        with torch.no_grad():
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad, expected[name], rtol=1e-10, atol=1e-12, msg=f"{name} step {step}")
                p -= 0.5 * p.grad
            for p, q in zip(reference.parameters(), model.parameters(), strict=True):
                p.copy_(q)


def wrapped() -> tuple[Net, PerSampleModule]:
    torch.manual_seed(0)
    model = Net()
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    return model, psm


@pytest.mark.parametrize("plain_first", [True, False], ids=["plain-compiled-before-wrapping", "after-wrapping"])
def test_compiled_wrapped_model_running_a_plain_copys_code_is_refused_naming_the_compiler(plain_first: bool) -> None:
    if plain_first:
        run_plain_compiled()
    model, psm = wrapped()
    if not plain_first:
        run_plain_compiled()
    compiled = torch.compile(model, backend="aot_eager")
    x, y = batch(0)
    psm.zero_grad()
    with pytest.raises(HookStateError, match=r"torch.compile .*skip_nnmodule_hook_guards.*torch._dynamo.reset\(\)"):
        loss(compiled(x), y).backward()
    assert all(p.grad is None for p in model.parameters())  # nothing half-written


@pytest.mark.parametrize("plain_first", [True, False], ids=["plain-compiled-before-wrapping", "after-wrapping"])
def test_reset_before_the_compiled_wrapped_models_first_call_is_exact_on_every_step(plain_first: bool) -> None:
    if plain_first:
        run_plain_compiled()
    model, psm = wrapped()
    if not plain_first:
        run_plain_compiled()
    torch._dynamo.reset()
    train(model, psm, torch.compile(model, backend="aot_eager"))


def test_hook_guards_on_before_compiling_anything_is_exact_on_every_step() -> None:
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        run_plain_compiled()
        model, psm = wrapped()
        train(model, psm, torch.compile(model, backend="aot_eager"))


def test_compiling_the_wrapper_after_a_plain_copy_is_exact_on_every_step() -> None:
    """The wrapper is another class: Dynamo compiles it afresh, hooks and all."""
    run_plain_compiled()
    model, psm = wrapped()
    train(model, psm, torch.compile(psm, backend="aot_eager"))


def test_the_refusal_does_not_name_the_compiler_where_nothing_was_compiled() -> None:
    torch.manual_seed(0)
    model = Net()
    x, y = batch(0)
    before = loss(model(x), y)  # a loss from a forward run before wrapping
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    with pytest.raises(HookStateError, match="a loss computed from a forward") as err:
        before.backward()
    assert "torch.compile" not in str(err.value)


class Own(nn.Module):
    """A user's own module class: ``model.compile()`` (in place) compiles its call. (On an ``nn.Sequential``,
    ``Net``, it compiles nothing in torch 2.13.)"""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


@pytest.mark.parametrize("compile_first", [True, False], ids=["compiled-then-wrapped", "wrapped-then-compiled"])
def test_a_model_compiled_in_place_is_exact_on_every_step(compile_first: bool) -> None:
    """``model.compile()`` before or after wrapping; positions on both sides of 16 and T == B, twice round."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = Own()
    reference = copy.deepcopy(model)  # (before compiling: a copy made after it would call the model's compiled call)
    if compile_first:
        model.compile(backend="aot_eager")
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    if not compile_first:
        model.compile(backend="aot_eager")
    counters.clear()
    train(model, psm, psm, steps=2 * len(SHAPES), reference=reference)
    assert counters["frames"]["ok"] > 0  # Dynamo compiled the model's frames: the steps ran compiled code


def test_the_compiled_autograd_flag_with_an_eager_backward_is_exact_on_every_step() -> None:
    """``torch._dynamo.config.compiled_autograd = True`` compiles only a backward run from compiled code: the
    compiled model's backward, run eagerly here, is autograd's own, pergrad's hooks and all."""
    model, psm = wrapped()
    with torch._dynamo.config.patch(compiled_autograd=True):
        train(model, psm, torch.compile(model, backend="aot_eager"), steps=2 * len(SHAPES))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_training_step_with_its_backward_and_optimizer_inside_is_exact_on_every_step(backend: str) -> None:
    """``torch.compile`` of a whole training step (forward, ``loss.backward()``, ``optimizer.step()``): the backward
    runs with Dynamo's frame callback set, and pergrad's backward hooks run eagerly under it. (With
    ``torch._dynamo.config.compiled_autograd`` on when the step is compiled, its backward is refused:
    ``tests/test_attack_compiled_step.py``.)"""
    model, psm = wrapped()
    reference = copy.deepcopy(model)
    step = torch.compile(sgd_step(psm, torch.optim.SGD(model.parameters(), lr=0.5)), backend=backend)
    for k in range(2 * len(SHAPES)):
        x, y = batch(k)
        expected = clipped_mean(reference, x, y)
        step(x, y)
        with torch.no_grad():
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p.grad, expected[name], rtol=1e-10, atol=1e-12, msg=f"{name} {k}")
                torch.testing.assert_close(p, q - 0.5 * expected[name], rtol=1e-10, atol=1e-12)
                q.copy_(p)


def test_compiled_autograd_is_refused_naming_it_and_writes_nothing() -> None:
    """Compiled autograd on around the forward and its backward (as torch asks) traces the backward's hooks into a
    graph; pergrad's end of a backward needs autograd's own engine. Refused at the backward's first hook, naming
    compiled autograd and the fix, before any ``.grad`` is written; without it the next steps are exact."""
    from torch._dynamo import compiled_autograd

    model, psm = wrapped()
    x, y = batch(0)
    psm.zero_grad()
    with (
        pytest.raises(HookStateError, match=r"runs under compiled autograd .* Run this backward without compiled"),
        compiled_autograd._enable(torch.compile(backend="aot_eager")),
    ):
        loss(psm(x), y).backward()
    assert all(p.grad is None for p in model.parameters())
    train(model, psm, torch.compile(model, backend="aot_eager"))

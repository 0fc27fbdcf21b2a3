"""What reaches a parameter, step after step: parameters a backward does not reach, terms of the
loss that start after the first backward, in-place transforms, and a backward after ``remove()``.
Every step is checked against torch.func in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pergrad import HookStateError, PerSampleModule, TransformError, transforms
from tests.reference import assert_close, reference_grad_sample, squared_error

STEPS = [(3, 20), (5, 17), (2, 24), (4, 18)]  # (batch, positions): 16+ positions, so weights run detached


class TwoHeads(nn.Module):
    """A body on every position and two heads, used on alternate steps."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 5)
        self.heads = nn.ModuleList([nn.Linear(5, 3), nn.Linear(5, 3)])

    def forward(self, x: torch.Tensor, head: int = 0) -> torch.Tensor:
        return self.heads[head](torch.tanh(self.body(x)).mean(1))


def batch(b: int, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, t, 4, generator=gen, dtype=torch.float64), torch.randn(b, 3, generator=gen).double()


def target_of(model: TwoHeads, kind: str) -> nn.Module | nn.Parameter:
    return {"root": model, "module": model.heads, "parameter": model.heads[1].weight}[kind]


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("kind", ["root", "module", "parameter"])
def test_a_user_transform_leaves_what_the_backward_did_not_reach_alone(keep: bool, kind: str) -> None:
    """As autograd (and clip_norm) do: the unused head's .grad stays None, so momentum and weight
    decay do not move it."""
    torch.manual_seed(0)
    model = TwoHeads().double()
    gen = torch.Generator().manual_seed(0)
    with PerSampleModule(model, keep_grad_sample=keep) as psm:
        psm.register_transform(target_of(model, kind), lambda g: g)
        for step, (b, t) in enumerate(STEPS):
            head = step % 2
            x, y = batch(b, t, gen)
            ref = reference_grad_sample(_Head(model, head), x, y)
            psm.zero_grad()
            (squared_error(psm(x, head), y) / b).backward()
            for name, p in model.named_parameters():
                if name.startswith(f"heads.{1 - head}."):
                    assert p.grad is None, f"step {step}: {name} was not reached"
                    continue
                assert_close(p.grad, ref[name].mean(0), f"step {step}: .grad of {name}")
                if keep:
                    assert_close(p.grad_sample, ref[name], f"step {step}: grad_sample of {name}")


class _Head(nn.Module):
    """``model`` with one head chosen (for the reference), same parameter names."""

    def __init__(self, model: TwoHeads, head: int) -> None:
        super().__init__()
        self.body, self.heads, self.head = model.body, model.heads, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads[self.head](torch.tanh(self.body(x)).mean(1))


def momentum_run(wrap: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    model = TwoHeads().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    psm = PerSampleModule(model) if wrap else None
    if psm is not None:
        psm.register_transform(model, lambda g: g)
    gen = torch.Generator().manual_seed(0)
    for step, (b, t) in enumerate(STEPS):
        x, y = batch(b, t, gen)
        opt.zero_grad()
        (squared_error(model(x, step % 2), y) / b).backward()
        opt.step()
    if psm is not None:
        psm.remove()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_an_identity_transform_trains_as_autograd_with_momentum_and_weight_decay() -> None:
    plain, wrapped = momentum_run(False), momentum_run(True)
    for name, value in plain.items():
        assert_close(wrapped[name], value, name)


class Warmup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)).mean(1))


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("kind", ["root", "module", "parameter"])
@pytest.mark.parametrize("on", ["inp.bias", "inp.weight"])
def test_a_term_that_starts_after_the_first_backward_is_refused(keep: bool, kind: str, on: str) -> None:
    """A warm-up regulariser: absent at step 0, weighted 0 at step 1 (nothing to drop: exact), then
    refused on the step it counts, naming the parameter, instead of being dropped."""
    torch.manual_seed(2)
    model = Warmup().double()
    target = {"root": model, "module": model.inp, "parameter": model.get_parameter(on)}[kind]
    gen = torch.Generator().manual_seed(0)
    with PerSampleModule(model, keep_grad_sample=keep) as psm:
        psm.register_transform(target, transforms.clip_norm(1e6) if kind != "parameter" else (lambda g: g))
        for step, (b, t) in enumerate(STEPS):
            x, y = batch(b, t, gen)
            ref = reference_grad_sample(model, x, y)
            psm.zero_grad()
            loss = squared_error(psm(x), y) / b
            if step > 0:
                loss = loss + (step - 1) * model.get_parameter(on).square().sum()
            if step < 2:
                loss.backward()
                for name, p in model.named_parameters():
                    assert_close(p.grad, ref[name].mean(0), f"step {step}: .grad of {name}")
                continue
            with pytest.raises(HookStateError, match=rf"parameter '{on}': its gradient has a part that no hooked"):
                loss.backward()
            break


class Checkpointed(Warmup):
    """``inp`` under reentrant activation checkpointing: in the outer backward a term on its weight is all that
    reaches the weight's ``AccumulateGrad`` node, which may then run before any hook of pergrad's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.inp(t)), x, use_reentrant=True)
        return self.out(h.mean(1))


@pytest.mark.parametrize("convert", [True, False], ids=["float-double-before-the-step", "not-converted"])
@pytest.mark.parametrize("on", ["inp.bias", "inp.weight"])
def test_a_term_after_a_conversion_there_and_back_is_refused(convert: bool, on: str) -> None:
    """``model.float().double()`` gives the parameters new ``AccumulateGrad`` nodes with dtype, device and tensor
    as before (the wrapper's layout unchanged). pergrad hooks them at the next forward: a term added in that step
    is refused, not added to a clipped ``.grad`` unclipped (before, the nodes were hooked when a backward's first
    hook of pergrad's ran, after the term's node had run)."""
    torch.manual_seed(2)
    model = Checkpointed().double()
    gen = torch.Generator().manual_seed(0)
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        for step, (b, t) in enumerate(STEPS[:3]):
            x, y = batch(b, t, gen)
            x.requires_grad_(True)  # (reentrant checkpointing: the segment's input must require grad)
            if step == 2 and convert:
                model.float().double()
            psm.zero_grad()
            loss = squared_error(psm(x), y) / b
            if step < 2:
                loss.backward()
                continue
            loss = loss + 0.1 * model.get_parameter(on).sum()
            with pytest.raises(HookStateError, match=rf"parameter '{on}'"):
                loss.backward()


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_a_backward_after_remove_gives_autograds_numbers(keep: bool, clip: float | None) -> None:
    """Steps inside the wrapper, then a forward inside it whose backward runs after ``remove()``:
    pergrad is gone, so every .grad is plain autograd's, the weights that ran detached included."""
    torch.manual_seed(3)
    model = Warmup().double()
    model.inp.bias = None  # a Linear without bias (pergrad's probe is its anchor)
    gen = torch.Generator().manual_seed(0)
    with PerSampleModule(model, keep_grad_sample=keep) as psm:
        if clip is not None:
            psm.register_transform(model, transforms.clip_norm(clip))
        for b, t in STEPS[:3]:
            x, y = batch(b, t, gen)
            psm.zero_grad()
            (squared_error(psm(x), y) / b).backward()
        x, y = batch(*STEPS[3], gen)
        out = psm(x)
    accumulated: list[str] = []
    model.inp.weight.register_post_accumulate_grad_hook(lambda p: accumulated.append("inp.weight"))
    model.zero_grad()
    (squared_error(out, y) / x.shape[0]).backward()
    assert accumulated == ["inp.weight"]
    ref = reference_grad_sample(model, x, y)
    for name, p in model.named_parameters():
        assert_close(p.grad, ref[name].mean(0), f".grad of {name} after remove()")
        assert not hasattr(p, "grad_sample")


@pytest.mark.parametrize("keep", [True, False])
def test_a_transform_that_writes_into_its_input_is_refused(keep: bool) -> None:
    torch.manual_seed(4)
    model = Warmup().double()
    gen = torch.Generator().manual_seed(0)
    with PerSampleModule(model, keep_grad_sample=keep) as psm:
        psm.register_transform(model.out.weight, lambda g: g.mul_(2))
        x, y = batch(*STEPS[0], gen)
        with pytest.raises(TransformError, match=r"parameter 'out.weight' modified its input 'out.weight' in place"):
            (squared_error(psm(x), y) / x.shape[0]).backward()
    with PerSampleModule(model, keep_grad_sample=keep) as psm:  # the fix the message gives
        psm.register_transform(model.out.weight, lambda g: g * 2)
        for b, t in STEPS:
            x, y = batch(b, t, gen)
            ref = reference_grad_sample(model, x, y)
            psm.zero_grad()
            (squared_error(psm(x), y) / b).backward()
            assert_close(model.out.weight.grad, 2 * ref["out.weight"].mean(0), "doubled")
            if keep:
                assert_close(model.out.weight.grad_sample, ref["out.weight"], "grad_sample before T")

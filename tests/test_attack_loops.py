"""An adversarial review of ``detach.FEW_FLOPS`` and the taps, as users' training loops of many steps.

Small Linears whose weight gradient costs fewer than ``FEW_FLOPS`` flops keep their weight attached where a
transform covers it, read through a tap (``pergrad._core.shortcuts.reach``) whose node's pre-hook tells what else
reached the weight. Each test runs the library's threshold (or one chosen to put a layer on both sides of it) for
20 to 100 steps and checks EVERY step in float64 against a one-sample-at-a-time autograd loop on a
``copy.deepcopy`` of the model: the clipped mean ``(1/B) sum_i min(1, C/||g_i||) g_i`` (the norm over every
parameter a target covers), the plain mean for the parameters no transform covers; DP-SGD's
``sum_i clip(g_i) / (q N)``. A term that reaches a covered weight outside its layers (a regulariser, a hook that
rescales, a second backward) must be refused, naming the parameter, with no ``.grad`` half-written, and the loop
must go on exact after it. The integrations (Lightning, the HF ``Trainer``, Opacus's ``no_op`` route) run their
real loops with small heads that now stay attached.
"""

from __future__ import annotations

import copy
import io
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from pergrad import HookStateError, PerSampleModule, transforms
from pergrad._core.shortcuts import detach
from tests.conftest import LIBRARY_FEW_FLOPS
from tests.test_attack_few_flops import (
    Tied,
    Wide,
    clipped_mean,
    close,
    detached_names,
    one_at_a_time,
    squared,
    token_loss,
)

pytestmark = pytest.mark.usefixtures("float64")

BOUND = 0.7
LR = 0.05
REACHED = "its gradient has a part that no hooked layer's output produced"


@pytest.fixture(autouse=True)
def library_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's own threshold (the suite's fixture sets 0); a test sets another where it says so."""
    monkeypatch.setattr(detach, "FEW_FLOPS", LIBRARY_FEW_FLOPS)


def trainable(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def expected_step(
    model: nn.Module,
    x: Tensor,
    t: Tensor,
    groups: Sequence[Iterable[str]] | None = None,
    bound: float = BOUND,
    loss: Callable[[Tensor, Tensor], Tensor] = squared,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Each sample's gradient (one at a time, on a deep copy) and what ``.grad`` must be: the clipped mean per
    group (default: every trainable parameter in one group), the plain mean elsewhere."""
    ref = one_at_a_time(model, x, t, loss)
    return ref, clipped_mean(ref, [trainable(model)] if groups is None else groups, bound)


def check_grads(model: nn.Module, expected: dict[str, Tensor], what: str) -> None:
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"{what}: {name} is frozen but has a .grad"
            continue
        close(p.grad, expected[name], f"{what}: .grad of {name}")


def grads_of(model: nn.Module) -> dict[str, Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def unchanged(model: nn.Module, before: dict[str, Tensor | None], what: str) -> None:
    for n, p in model.named_parameters():
        if before[n] is None:
            assert p.grad is None, f"{what}: {n} got a .grad"
        else:
            assert p.grad is not None and torch.equal(p.grad, before[n]), f"{what}: {n}'s .grad half-written"


def sgd(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(LR * p.grad)


def cycle(sizes: Sequence[int], steps: int) -> list[int]:
    return [sizes[i % len(sizes)] for i in range(steps)]


WIDE_SIZES = [31, 32, 8, 33, 64, 2, 40, 16, 32, 1, 48, 31]  # the wide layer's B L crosses 32 both ways


def wide_detached(step: int, b: int) -> set[str]:
    """What runs detached in ``Wide`` at the library threshold: wide's weight from the second step at B >= 32
    (inp: 1024 weights, head: 512, never reach 2**22 flops at these batches)."""
    return {"wide.weight"} if step > 0 and b >= 32 else set()


# -- one process, plain loops ----------------------------------------------------------------------------------


def test_a_hundred_steps_with_eval_a_checkpoint_rollback_and_adamw() -> None:
    """100 steps of AdamW (weight decay) with batches crossing the wide layer's threshold, evaluation under
    ``no_grad`` and ``inference_mode`` every 7 steps, a checkpoint saved with ``torch.save`` at step 30 and loaded
    back in place (``load_state_dict``) at step 60: every step's ``.grad`` is the clipped mean."""
    torch.manual_seed(100)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(101)
    saved = io.BytesIO()
    sizes = cycle(WIDE_SIZES, 100)
    for step, b in enumerate(sizes):
        if step % 7 == 3:
            psm.eval()
            with torch.no_grad():
                psm(torch.randn(100, 4, generator=g))
            with torch.inference_mode():
                psm(torch.randn(33, 4, generator=g))
            psm.train()
        if step == 30:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
        if step == 60:
            saved.seek(0)
            state = torch.load(saved)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        x, t = torch.randn(b, 4, generator=g), torch.randn(b, 2, generator=g)
        _, expected = expected_step(model, x, t)
        opt.zero_grad()
        out = psm(x)
        assert detached_names(psm, model) == wide_detached(step, b), f"step {step} (B={b})"
        squared(out, t).mean().backward()
        check_grads(model, expected, f"step {step} (B={b})")
        opt.step()
    psm.remove()


class Small(nn.Module):
    """Three small Linears: ``mid`` (16x16, 256 weights) is the one a chosen threshold puts on both sides."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


SMALL_FEW = 2 * 8 * 256  # mid: detached from B = 8 (inp: 48 weights, head: 32: from B = 43 and 64)
SMALL_SIZES = [7, 8, 9, 1, 16, 8, 7, 43, 42, 64, 63, 5]


def small_detached(step: int, b: int, model: nn.Module) -> set[str]:
    return {
        n
        for n in ("inp.weight", "mid.weight", "head.weight")
        if step > 0 and 2 * b * model.get_parameter(n).numel() >= SMALL_FEW
    }


@pytest.mark.parametrize("keep", [False, True])
def test_sixty_steps_straddling_a_chosen_threshold_through_float_and_double(
    monkeypatch: pytest.MonkeyPatch, keep: bool
) -> None:
    """A threshold that puts all three layers on both sides as the batch goes 1..64; ``model.float()`` at step 20
    (float32 steps, float32's precision against the float64 reference), ``model.double()`` at step 30."""
    monkeypatch.setattr(detach, "FEW_FLOPS", SMALL_FEW)
    torch.manual_seed(102)
    model = Small()
    psm = PerSampleModule(model, keep_grad_sample=keep)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(103)
    seen = set()
    for step, b in enumerate(cycle(SMALL_SIZES, 60)):
        if step == 20:
            model.float()
        if step == 30:
            model.double()
        dtype = next(model.parameters()).dtype
        x, t = torch.randn(b, 3, generator=g), torch.randn(b, 2, generator=g)
        ref, expected = expected_step(copy.deepcopy(model).double(), x, t)
        psm.zero_grad()
        out = psm(x.to(dtype))
        found = detached_names(psm, model)
        # (a conversion is new data: the wrapper binds again, and its next backward is checked against autograd's)
        assert found == (set() if step in (20, 30) else small_detached(step, b, model)), f"step {step} (B={b}): {found}"
        seen.add(frozenset(found))
        squared(out.double(), t).mean().backward()
        for name, p in model.named_parameters():
            if dtype == torch.float64:
                close(p.grad, expected[name], f"step {step} (B={b}) {name}")
                if keep:
                    close(p.grad_sample, ref[name], f"step {step} grad_sample {name}")
            else:
                assert p.grad is not None and p.grad.dtype == torch.float32
                torch.testing.assert_close(p.grad.double(), expected[name], rtol=2e-4, atol=1e-6, msg=f"{step} {name}")
        sgd(model)
    assert len(seen) >= 4, seen
    psm.remove()


def test_freezing_and_unfreezing_covered_layers_mid_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """40 steps; ``inp`` frozen at step 10 and back at 20, ``head`` frozen at 25, ``mid`` frozen at 30 (its .grad
    dropped), everything back at 35: the clipping covers the trainable parameters of each step, frozen ones get
    no .grad, and ``mid`` crosses a chosen threshold throughout."""
    monkeypatch.setattr(detach, "FEW_FLOPS", SMALL_FEW)
    torch.manual_seed(104)
    model = Small()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(105)
    plan = {10: ("inp", False), 20: ("inp", True), 25: ("head", False), 30: ("mid", False), 35: ("", True)}
    for step, b in enumerate(cycle(SMALL_SIZES, 40)):
        if step in plan:
            name, on = plan[step]
            module = model.get_submodule(name)
            module.requires_grad_(on)
            if not on:
                for p in module.parameters():
                    p.grad = None
        x, t = torch.randn(b, 3, generator=g), torch.randn(b, 2, generator=g)
        _, expected = expected_step(model, x, t)
        psm.zero_grad()
        out = psm(x)
        found = detached_names(psm, model)
        assert found <= {n for n in small_detached(step, b, model) if model.get_parameter(n).requires_grad}, found
        squared(out, t).mean().backward()
        check_grads(model, expected, f"step {step} (B={b})")
        sgd(model)
    psm.remove()


def regularised(model: nn.Module, name: str, lam: float = 0.01) -> Tensor:
    return lam * model.get_parameter(name).square().sum()


@pytest.mark.parametrize("prefilled", [False, True])
def test_a_regulariser_switched_on_and_off_is_refused_each_time(prefilled: bool) -> None:
    """40 steps; every third one adds ``lam * W.square().sum()`` on a covered parameter, in turn the small inp's
    weight (attached), the wide weight (attached below B = 32, detached above) and a bias: each is refused naming
    the parameter, ``.grad`` as it was (None, or the last step's kept with ``zero_grad(set_to_none=False)``), and
    the steps after it are exact."""
    torch.manual_seed(106)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(107)
    # (the refused steps' batches go 8, 2, 32, 31: the wide weight is refused detached at 32, attached at 31)
    on = ["inp.weight", "head.bias", "wide.weight", "wide.weight", "inp.weight", "head.weight"]
    refused = []
    for step, b in enumerate(cycle(WIDE_SIZES, 40)):
        x, t = torch.randn(b, 4, generator=g), torch.randn(b, 2, generator=g)
        if step % 3 == 2:
            if not prefilled:
                psm.zero_grad()
            name = on[len(refused) % len(on)]
            before = grads_of(model)
            loss = squared(psm(x), t).mean() + regularised(model, name)
            refused.append((name, name in detached_names(psm, model)))
            with pytest.raises(HookStateError, match=re.escape(f"parameter '{name}'")):
                loss.backward()
            unchanged(model, before, f"step {step} ({name}, B={b})")
            continue
        _, expected = expected_step(model, x, t)
        psm.zero_grad(set_to_none=not prefilled)
        out = psm(x)
        assert detached_names(psm, model) == wide_detached(step, b), f"step {step}"
        squared(out, t).mean().backward()
        check_grads(model, expected, f"step {step} (B={b})")
        sgd(model)
    assert ("wide.weight", True) in refused and ("wide.weight", False) in refused, refused
    psm.remove()


def test_a_regulariser_on_an_attached_weight_no_transform_covers_is_autograds() -> None:
    """Clipping per module on ``inp`` and ``wide`` only: an L2 term on ``head`` (no transform: autograd's
    ``.grad``), switched on from step 3 (the first backward's check refuses it: its sums must agree), adds
    ``2 lam W`` to the plain mean at every step; the same term on the small ``inp`` is refused at every step."""
    torch.manual_seed(108)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform("inp", transforms.clip_norm(BOUND / 2))
    psm.register_transform("wide", transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(109)
    lam = 0.05
    for step, b in enumerate(cycle(WIDE_SIZES, 30)):
        x, t = torch.randn(b, 4, generator=g), torch.randn(b, 2, generator=g)
        ref = one_at_a_time(model, x, t)
        expected = clipped_mean(ref, [["wide.weight", "wide.bias"]])
        expected.update(
            {n: v for n, v in clipped_mean(ref, [["inp.weight", "inp.bias"]], BOUND / 2).items() if n.startswith("inp")}
        )
        if step >= 3:
            expected["head.weight"] = expected["head.weight"] + 2 * lam * model.head.weight.detach()
        psm.zero_grad()
        out = psm(x)
        if step % 10 == 9:
            with pytest.raises(HookStateError, match=re.escape("parameter 'inp.weight'") + ".*" + re.escape(REACHED)):
                (squared(out, t).mean() + regularised(model, "inp.weight")).backward()
            assert all(p.grad is None for p in model.parameters()), f"step {step}"
            continue
        if step == 0:
            with pytest.raises(HookStateError, match=re.escape("parameter 'head.weight'") + ".*" + re.escape(REACHED)):
                (squared(out, t).mean() + regularised(model, "head.weight", lam)).backward()
            assert all(p.grad is None for p in model.parameters())
            out = psm(x)
        (squared(out, t).mean() + (regularised(model, "head.weight", lam) if step >= 3 else 0)).backward()
        check_grads(model, expected, f"step {step} (B={b})")
        sgd(model)
    psm.remove()


def test_a_regulariser_on_a_tied_embedding_and_head_is_refused() -> None:
    """An embedding tied to the output layer (both small: attached), sequences of 15 to 17 tokens, 24 steps; every
    fourth adds an L2 term on the tied weight, refused; the others are exact (grad_sample kept too)."""
    torch.manual_seed(110)
    model = Tied()
    psm = PerSampleModule(model, keep_grad_sample=True)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(111)
    for step, (b, length) in enumerate(cycle([(3, 16), (2, 15), (4, 17), (1, 16), (5, 3)], 24)):
        x, t = torch.randint(11, (b, length), generator=g), torch.randint(11, (b, length), generator=g)
        psm.zero_grad()
        if step % 4 == 3:
            loss = token_loss(psm(x), t).mean() + regularised(model, "emb.weight")
            with pytest.raises(HookStateError, match=re.escape("parameter 'emb.weight'")):
                loss.backward()
            assert all(p.grad is None for p in model.parameters()), f"step {step}"
            continue
        ref, expected = expected_step(model, x, t, loss=token_loss)
        out = psm(x)
        assert detached_names(psm, model) == set(), f"step {step}"
        token_loss(out, t).mean().backward()
        check_grads(model, expected, f"step {step}")
        for name, p in model.named_parameters():
            close(p.grad_sample, ref[name], f"step {step} grad_sample of {name}")
        sgd(model)
    psm.remove()


class Twice(nn.Module):
    """One small Linear called twice per forward, on the features and on their square."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 16)
        self.lin = nn.Linear(16, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(torch.tanh(self.lin(h)) * torch.tanh(self.lin(h.square())))


@pytest.mark.parametrize("few", [LIBRARY_FEW_FLOPS, SMALL_FEW])
def test_a_linear_called_twice_with_a_regulariser_some_steps(monkeypatch: pytest.MonkeyPatch, few: int) -> None:
    """30 steps; every fifth adds a term on ``lin``'s weight (its two calls read one tap): refused; the other steps
    are exact, ``lin`` attached at every step (library threshold) or on both sides (a chosen one)."""
    monkeypatch.setattr(detach, "FEW_FLOPS", few)
    torch.manual_seed(112)
    model = Twice()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(113)
    sides = set()
    for step, b in enumerate(cycle(SMALL_SIZES, 30)):
        x, t = torch.randn(b, 3, generator=g), torch.randn(b, 2, generator=g)
        psm.zero_grad()
        out = psm(x)
        lin = "lin.weight" in detached_names(psm, model)
        assert lin == (step > 0 and 2 * b * 256 >= few), f"step {step}"
        if step % 5 == 4:
            with pytest.raises(HookStateError, match=re.escape("parameter 'lin.weight'")):
                (squared(out, t).mean() + regularised(model, "lin.weight")).backward()
            assert all(p.grad is None for p in model.parameters())
            continue
        sides.add(lin)
        _, expected = expected_step(model, x, t)
        squared(out, t).mean().backward()
        check_grads(model, expected, f"step {step} (B={b})")
        sgd(model)
    assert sides == ({False} if few == LIBRARY_FEW_FLOPS else {False, True}), sides
    psm.remove()


@pytest.mark.parametrize("how", ["backward", "samples"])
def test_micro_batches_with_a_regulariser_in_the_last_one(how: str) -> None:
    """Three micro-batches per step (sizes on both sides of the wide layer's threshold), 20 steps; at every fourth
    step the last micro-batch's loss carries a term on the small inp's weight: refused, and ``.grad`` holds exactly
    what the first two wrote; the next steps are exact."""
    torch.manual_seed(114)
    model = Wide()
    names = trainable(model)
    psm = PerSampleModule(model, keep_grad_sample=False, accumulate=how)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(115)
    splits = [(40, 8, 33), (8, 31, 2), (32, 32, 1), (5, 64, 16)]
    for step in range(20):
        sizes = splits[step % len(splits)]
        parts = [(torch.randn(b, 4, generator=g), torch.randn(b, 2, generator=g)) for b in sizes]
        refs = [one_at_a_time(model, x, t) for x, t in parts]
        broken = step % 4 == 3

        def expected_of(refs: list[dict[str, Tensor]]) -> dict[str, Tensor]:
            if how == "backward":
                return {n: sum(clipped_mean(r, [names])[n] for r in refs) for n in names}
            return clipped_mean({n: torch.cat([r[n] for r in refs]) for n in names}, [names])

        psm.zero_grad(set_to_none=False)
        for k, (x, t) in enumerate(parts):
            loss = squared(psm(x), t).mean()
            if broken and k == 2:
                before = grads_of(model)
                with pytest.raises(HookStateError, match=re.escape("parameter 'inp.weight'")):
                    (loss + regularised(model, "inp.weight")).backward()
                unchanged(model, before, f"step {step}")
            else:
                loss.backward()
        check_grads(model, expected_of(refs[:2] if broken else refs), f"step {step} {sizes}")
        sgd(model)
    psm.remove()


def test_hooks_of_the_users_added_and_removed_mid_run() -> None:
    """40 steps. Steps 5-14: a gradient logger on ``wide.weight`` (it then stays attached at every batch) sees
    autograd's batch gradient once per backward. Steps 15-19: a hook that rescales it is refused, naming the
    parameter. From step 20 both are removed (wide runs detached at B >= 32 again). Throughout, a rescaling hook on
    the head's weight (no transform covers it) doubles its plain mean, as in autograd."""
    torch.manual_seed(116)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform("inp", transforms.clip_norm(BOUND))
    psm.register_transform("wide", transforms.clip_norm(BOUND))
    model.head.weight.register_hook(lambda grad: 2 * grad)
    g = torch.Generator().manual_seed(117)
    logged: list[Tensor] = []
    handles: list[Any] = []
    for step, b in enumerate(cycle(WIDE_SIZES, 40)):
        if step == 5:
            handles.append(model.wide.weight.register_hook(lambda grad: logged.append(grad.clone())))
        if step == 15:
            handles.append(model.wide.weight.register_hook(lambda grad: grad * 0.5))
        if step == 20:
            for handle in handles:
                handle.remove()
        x, t = torch.randn(b, 4, generator=g), torch.randn(b, 2, generator=g)
        ref = one_at_a_time(model, x, t)
        expected = clipped_mean(ref, [["wide.weight", "wide.bias"]])
        expected.update(
            {n: v for n, v in clipped_mean(ref, [["inp.weight", "inp.bias"]]).items() if n.startswith("inp")}
        )
        expected["head.weight"] = 2 * expected["head.weight"]
        psm.zero_grad()
        out = psm(x)
        hooked = 5 <= step < 20
        assert detached_names(psm, model) == (set() if hooked else wide_detached(step, b)), f"step {step}"
        loss = squared(out, t).mean()
        if 15 <= step < 20:
            with pytest.raises(HookStateError, match=re.escape("parameter 'wide.weight': a hook registered on it")):
                loss.backward()
            assert all(p.grad is None for p in model.parameters())
            logged.pop()
            continue
        loss.backward()
        check_grads(model, expected, f"step {step} (B={b})")
        if hooked:
            close(logged[-1], ref["wide.weight"].mean(0), f"step {step}: the logged gradient")
        sgd(model)
    assert len(logged) == 10
    psm.remove()


def test_autograd_grad_of_small_weights_before_each_backward() -> None:
    """A loop that logs the batch gradient of the small covered weights with ``torch.autograd.grad(...,
    retain_graph=True)`` before ``loss.backward()``: autograd's batch mean, and then the clipped mean in ``.grad``,
    at 30 steps with the wide layer on both sides."""
    torch.manual_seed(118)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(119)
    for step, b in enumerate(cycle(WIDE_SIZES, 30)):
        x, t = torch.randn(b, 4, generator=g), torch.randn(b, 2, generator=g)
        ref, expected = expected_step(model, x, t)
        psm.zero_grad()
        out = psm(x)
        assert detached_names(psm, model) == wide_detached(step, b)
        loss = squared(out, t).mean()
        logged = torch.autograd.grad(loss, [model.inp.weight, model.head.weight, model.head.bias], retain_graph=True)
        for name, got in zip(("inp.weight", "head.weight", "head.bias"), logged):
            close(got, ref[name].mean(0), f"step {step}: autograd.grad of {name}")
        assert all(p.grad is None for p in model.parameters())
        loss.backward()
        check_grads(model, expected, f"step {step} (B={b})")
        sgd(model)
    psm.remove()


def test_a_second_backward_of_a_clipped_forward_is_refused_and_leaves_the_first() -> None:
    """``retain_graph=True`` and a second loss of the same forward: under clipping (not additive) refused, the
    first backward's clipped mean left in ``.grad``; 20 steps, every fifth one tries it."""
    torch.manual_seed(120)
    model = Small()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(121)
    for step, b in enumerate(cycle(SMALL_SIZES, 20)):
        x, t = torch.randn(b, 3, generator=g), torch.randn(b, 2, generator=g)
        _, expected = expected_step(model, x, t)
        psm.zero_grad()
        out = psm(x)
        twice = step % 5 == 4
        squared(out, t).mean().backward(retain_graph=twice)
        if twice:
            with pytest.raises(HookStateError, match=r"second backward through the same forward.*not additive"):
                out.pow(3).sum(1).mean().backward()
        check_grads(model, expected, f"step {step} (B={b})")
        sgd(model)
    psm.remove()


class Teacher(nn.Module):
    """``mid`` called once under ``no_grad`` (a teacher's target) and once with gradients, in either order."""

    def __init__(self, teacher_first: bool) -> None:
        super().__init__()
        self.teacher_first = teacher_first
        self.inp = nn.Linear(3, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        if self.teacher_first:
            with torch.no_grad():
                target = self.mid(h)
        h2 = torch.tanh(self.mid(h))
        if not self.teacher_first:
            with torch.no_grad():
                target = self.mid(h)
        return self.head(h2 + 0.1 * target)


@pytest.mark.parametrize("teacher_first", [True, False])
@pytest.mark.parametrize("few", [LIBRARY_FEW_FLOPS, SMALL_FEW])
def test_a_layer_also_called_under_no_grad_in_the_forward(
    monkeypatch: pytest.MonkeyPatch, teacher_first: bool, few: int
) -> None:
    monkeypatch.setattr(detach, "FEW_FLOPS", few)
    torch.manual_seed(122)
    model = Teacher(teacher_first)
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(123)
    sides = set()
    for step, b in enumerate(cycle(SMALL_SIZES, 24)):
        x, t = torch.randn(b, 3, generator=g), torch.randn(b, 2, generator=g)
        _, expected = expected_step(model, x, t)
        psm.zero_grad()
        out = psm(x)
        sides.add("mid.weight" in detached_names(psm, model))
        squared(out, t).mean().backward()
        check_grads(model, expected, f"step {step} (B={b})")
        sgd(model)
    assert sides == ({False} if few == LIBRARY_FEW_FLOPS else {False, True}), sides
    psm.remove()


def test_wrapped_again_after_loading_a_checkpoint_into_a_fresh_model() -> None:
    """Steps 0-14 on one model; then the wrapper is removed, the state saved, a fresh model built and loaded, wrapped
    again (its first backward's check again) with the optimizer's state: 30 steps, every one exact."""
    torch.manual_seed(124)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.01)
    g = torch.Generator().manual_seed(125)
    for step, b in enumerate(cycle(WIDE_SIZES, 30)):
        if step == 15:
            psm.remove()
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
            buffer.seek(0)
            state = torch.load(buffer)
            model = Wide()
            model.load_state_dict(state["model"])
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.01)
            opt.load_state_dict(state["opt"])
            psm = PerSampleModule(model, keep_grad_sample=False)
            psm.register_transform(model, transforms.clip_norm(BOUND))
        x, t = torch.randn(b, 4, generator=g), torch.randn(b, 2, generator=g)
        _, expected = expected_step(model, x, t)
        opt.zero_grad()
        out = psm(x)
        assert detached_names(psm, model) == wide_detached(step % 15, b), f"step {step}"
        squared(out, t).mean().backward()
        check_grads(model, expected, f"step {step} (B={b})")
        opt.step()
    psm.remove()


def test_per_parameter_and_per_module_targets_leave_the_rest_plain() -> None:
    """Clipping on ``inp.weight`` alone (its bias uncovered) and on ``wide``; ``head`` uncovered and frozen from
    step 20: 40 steps, the covered parameters' clipped means (each target's own norm), the others' plain means."""
    torch.manual_seed(126)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform("inp.weight", transforms.clip_norm(BOUND / 4))
    psm.register_transform("wide", transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(127)
    for step, b in enumerate(cycle(WIDE_SIZES, 40)):
        if step == 20:
            model.head.requires_grad_(False)
            model.head.zero_grad()
        x, t = torch.randn(b, 4, generator=g), torch.randn(b, 2, generator=g)
        ref = one_at_a_time(model, x, t)
        expected = clipped_mean(ref, [["wide.weight", "wide.bias"]])
        expected["inp.weight"] = clipped_mean(ref, [["inp.weight"]], BOUND / 4)["inp.weight"]
        psm.zero_grad()
        out = psm(x)
        # (requires_grad changed: the wrapper binds again, and its next backward is checked against autograd's)
        assert detached_names(psm, model) == wide_detached(step % 20, b), f"step {step}"
        squared(out, t).mean().backward()
        check_grads(model, expected, f"step {step} (B={b})")
        sgd(model)
    psm.remove()


def test_a_regulariser_backpropagated_on_its_own_after_the_loss() -> None:
    """``loss.backward()`` then ``(lam * W.square().sum()).backward()`` (a second backward that reaches the weight
    only outside its layer), on the small inp's weight (attached) and the wide one (on both sides): refused naming
    it, the first backward's clipped mean left in ``.grad``; 24 steps."""
    torch.manual_seed(132)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(133)
    for step, b in enumerate(cycle(WIDE_SIZES, 24)):
        x, t = torch.randn(b, 4, generator=g), torch.randn(b, 2, generator=g)
        _, expected = expected_step(model, x, t)
        psm.zero_grad()
        squared(psm(x), t).mean().backward()
        check_grads(model, expected, f"step {step} (B={b})")
        name = ("inp.weight", "wide.weight", "head.bias")[step % 3]
        with pytest.raises(HookStateError, match=re.escape(f"parameter '{name}'")):
            regularised(model, name).backward()
        check_grads(model, expected, f"step {step} (B={b}) after the refused term")
        sgd(model)
    psm.remove()


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_regulariser_on_weights_inside_a_checkpointed_segment(reentrant: bool) -> None:
    """Activation checkpointing around the wide layer and a small one (the segment is computed again in the
    backward, reading the same taps): 24 steps across the threshold; every fourth one adds a term on a weight
    inside the segment or outside it, refused naming it; the others exact."""
    from tests.test_attack_few_flops import Checkpointed

    torch.manual_seed(134)
    model = Checkpointed(reentrant)
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(135)
    names = ["small.weight", "wide.weight", "inp.weight", "wide.weight", "head.weight", "small.bias"]
    for step, b in enumerate(cycle(WIDE_SIZES, 24)):
        x, t = torch.randn(b, 4, generator=g).requires_grad_(reentrant), torch.randn(b, 2, generator=g)
        psm.zero_grad()
        if step % 4 == 3:
            name = names[(step // 4) % len(names)]
            with pytest.raises(HookStateError, match=re.escape(f"parameter '{name}'") + ".*" + re.escape(REACHED)):
                (squared(psm(x), t).mean() + regularised(model, name)).backward()
            assert all(p.grad is None for p in model.parameters()), f"step {step}"
            continue
        _, expected = expected_step(model, x, t)
        squared(psm(x), t).mean().backward()
        check_grads(model, expected, f"step {step} (B={b})")
        sgd(model)
    psm.remove()


class Scaled(nn.Module):
    """The output scaled by the norm of the head's weight, read by the parent outside the head's call."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.inp(x))) / self.head.weight.norm()


def test_a_weight_the_parent_reads_in_the_forward_is_refused_at_every_step() -> None:
    """The parent divides by ``head.weight.norm()``: a use of the (small, attached) covered weight outside its
    layer, refused at every step naming it; without a transform on it (clipping ``inp`` alone) ``.grad`` of head
    is autograd's (its tap then absent) and ``inp``'s the clipped mean, 20 steps."""
    torch.manual_seed(136)
    model = Scaled()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(137)
    for step in range(5):
        x, t = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
        psm.zero_grad()
        with pytest.raises(HookStateError, match=re.escape("parameter 'head.weight'") + ".*" + re.escape(REACHED)):
            squared(psm(x), t).mean().backward()
        assert all(p.grad is None for p in model.parameters()), f"step {step}"
    psm.remove()
    psm = PerSampleModule(model, keep_grad_sample=False, verify=False)
    psm.register_transform("inp", transforms.clip_norm(BOUND))
    for step, b in enumerate(cycle(SMALL_SIZES, 20)):
        x, t = torch.randn(b, 4, generator=g), torch.randn(b, 2, generator=g)
        _, expected = expected_step(model, x, t, groups=[["inp.weight", "inp.bias"]])
        psm.zero_grad()
        squared(psm(x), t).mean().backward()
        check_grads(model, expected, f"step {step} (B={b})")
        sgd(model)
    psm.remove()


def test_adversarial_training_with_the_input_gradient_each_step() -> None:
    """FGSM: ``torch.autograd.grad(loss, x)`` (a backward that writes no ``.grad``), the batch moved along its sign,
    then the step on it: ``.grad`` is the clipped mean at the moved inputs, 30 steps across the threshold."""
    torch.manual_seed(138)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(139)
    for step, b in enumerate(cycle(WIDE_SIZES, 30)):
        x, t = torch.randn(b, 4, generator=g), torch.randn(b, 2, generator=g)
        psm.zero_grad()
        (gx,) = torch.autograd.grad(squared(psm(x.requires_grad_(True)), t).mean(), x)
        assert all(p.grad is None for p in model.parameters()), f"step {step}"
        moved = (x + 0.1 * gx.sign()).detach()
        _, expected = expected_step(model, moved, t)
        out = psm(moved)
        assert detached_names(psm, model) == wide_detached(step, b), f"step {step}"
        squared(out, t).mean().backward()
        check_grads(model, expected, f"step {step} (B={b})")
        sgd(model)
    psm.remove()


def test_a_gradient_penalty_on_the_input_is_refused_at_every_step() -> None:
    """R1-like: ``autograd.grad(loss, x, create_graph=True)`` and its square added to the loss differentiates the
    layers' backward, which their ``(a, d)`` do not give: refused (``SecondOrderError``) at each of 5 steps, for the
    small attached weights as for any, no ``.grad`` written; then plain steps are exact again."""
    from pergrad.errors import SecondOrderError

    torch.manual_seed(140)
    model = Small()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(141)
    for step, b in enumerate(cycle(SMALL_SIZES, 12)):
        x, t = torch.randn(b, 3, generator=g), torch.randn(b, 2, generator=g)
        psm.zero_grad()
        if step < 5:
            x.requires_grad_(True)
            loss = squared(psm(x), t)
            (gx,) = torch.autograd.grad(loss.sum(), x, create_graph=True)
            with pytest.raises(SecondOrderError, match=r"gradient penalty"):
                (loss.mean() + 0.3 * gx.square().sum(1).mean()).backward()
            assert all(p.grad is None for p in model.parameters()), f"step {step}"
            continue
        _, expected = expected_step(model, x, t)
        squared(psm(x), t).mean().backward()
        check_grads(model, expected, f"step {step} (B={b})")
        sgd(model)
    psm.remove()


# -- DP-SGD (pergrad.privacy) ----------------------------------------------------------------------------------


def poisson(n: int, q: float, seed: int, steps: int) -> tuple[Any, DataLoader]:
    from pergrad.privacy import PoissonBatchSampler, collate_with_empty

    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g))
    sampler = PoissonBatchSampler(n, q, steps=steps, generator=torch.Generator().manual_seed(seed + 1))
    return sampler, DataLoader(data, batch_sampler=sampler, collate_fn=collate_with_empty(data))


def test_dpsgd_poisson_batches_across_the_wide_layers_threshold() -> None:
    """``pergrad.privacy.DPSGD`` without noise, Poisson batches of 160 samples at q = 0.2 (expected 32: the wide
    layer on both sides), 30 steps: ``.grad`` after the noise is ``sum_i clip(g_i) / (q N)`` at every step, for every
    parameter; no parameter is left outside the clipping."""
    from pergrad.privacy import DPSGD

    torch.manual_seed(128)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sampler, loader = poisson(160, 0.2, 129, 30)
    dp = DPSGD(psm, opt, sampler, max_grad_norm=BOUND, noise_multiplier=0.0)
    sizes, sides = [], set()
    for step, (x, t) in enumerate(loader):
        b = x.shape[0]
        sizes.append(b)
        ref = one_at_a_time(model, x, t)
        expected = {n: v * b / (0.2 * 160) for n, v in clipped_mean(ref, [trainable(model)]).items()}
        opt.zero_grad()
        out = psm(x)
        found = detached_names(psm, model)
        assert found == wide_detached(step, b), f"step {step} (B={b})"
        sides.add(frozenset(found))
        squared(out, t).mean().backward()
        dp.add_noise()
        check_grads(model, expected, f"step {step} (B={b})")
        opt.step()
    assert dp.steps == 30 and min(sizes) < 32 <= max(sizes) and len(sides) == 2, (sizes, sides)
    dp.remove()
    psm.remove()


def test_dpsgd_refuses_a_regulariser_on_an_attached_weight_before_any_step() -> None:
    """In the same DP-SGD loop, a step whose loss carries ``lam * W.square().sum()`` on the small inp's weight
    (attached) is refused in its backward, naming it; the parameters do not move and no ``.grad`` is written."""
    from pergrad.privacy import DPSGD

    torch.manual_seed(130)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sampler, loader = poisson(160, 0.2, 131, 8)
    dp = DPSGD(psm, opt, sampler, max_grad_norm=BOUND, noise_multiplier=1.0)
    for step, (x, t) in enumerate(loader):
        opt.zero_grad()
        loss = squared(psm(x), t).mean()
        if step < 5:
            loss.backward()
            opt.step()
            continue
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(HookStateError, match=re.escape("parameter 'inp.weight'") + ".*" + re.escape(REACHED)):
            (loss + regularised(model, "inp.weight")).backward()
        assert all(p.grad is None for p in model.parameters())
        for n, p in model.named_parameters():
            assert torch.equal(p, params[n]), n
        break
    assert dp.steps == 5
    dp.remove()
    psm.remove()


# -- Lightning --------------------------------------------------------------------------------------------------


def lightning_net(regulariser: bool = False) -> Any:
    """``(lit, net)``: ``tests/test_lightning.py`` (its ``trainer`` and ``data``) and the network below."""
    pytest.importorskip("lightning.pytorch")
    from tests import test_lightning as lit

    class Net(lit.Net):
        """``test_lightning``'s recording MLP (small Linears: attached at the library threshold), with a validation
        step under Lightning's no_grad and a regulariser at step 3 where asked."""

        def __init__(self) -> None:
            super().__init__()
            self.validated = 0

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            if regulariser and self.global_step == 3:
                loss = loss + 0.01 * self.model[2].weight.square().sum()
            return loss

        def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
            self.validated += 1
            self.log("val", F.cross_entropy(self.model(batch[0]), batch[1]))

    return lit, Net()


def at_params(model: nn.Module, params: dict[str, Tensor]) -> nn.Module:
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(params[n])
    return ref


def cross_entropy_each(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def test_lightning_thirty_steps_with_validation_and_accumulation(tmp_path: Path) -> None:
    """``PerSample`` clipping, ``accumulate_grad_batches=2`` over batches of 5 (the epoch's last one of 2), a
    validation loop every 4 batches: every optimizer step's ``.grad`` is ``(1/2) sum_m mean_{i in m} clip(g_i)``."""
    from pergrad.integrations.lightning import PerSample

    lit, net = lightning_net()
    callback = PerSample("model", transforms={"": transforms.clip_norm(BOUND)})
    train = DataLoader(lit.data(27, seed=1), batch_size=5)  # 6 batches per epoch: 3 steps
    val = DataLoader(lit.data(6, seed=2), batch_size=3)
    trainer = lit.trainer(
        tmp_path,
        num_sanity_val_steps=0,
        callbacks=[callback],
        max_epochs=10,
        accumulate_grad_batches=2,
        val_check_interval=4,
    )
    trainer.fit(net, train, val)
    assert len(net.records) == 30 and net.validated > 0
    for step, record in enumerate(net.records):
        ref = at_params(net.model, record["params"])
        expected: dict[str, Tensor] = {}
        for x, y in record["micro"]:
            for n, v in clipped_mean(one_at_a_time(ref, x, y, cross_entropy_each), [trainable(ref)]).items():
                expected[n] = expected.get(n, 0) + v / 2
        for n, got in record["grad"].items():
            close(got, expected[n], f"step {step} {n}")
    assert callback.psm is None


def test_lightning_regulariser_in_the_training_step_is_refused_and_unwraps(tmp_path: Path) -> None:
    """A term on the small head's weight added in ``training_step`` at step 3: ``fit`` raises naming it, before the
    optimizer moves anything, and the network is left without pergrad's hooks."""
    from pergrad.integrations.lightning import PerSample

    lit, net = lightning_net(regulariser=True)
    callback = PerSample("model", transforms={"": transforms.clip_norm(BOUND)})
    with pytest.raises(HookStateError, match=re.escape("parameter '2.weight'") + ".*" + re.escape(REACHED)):
        lit.trainer(tmp_path, num_sanity_val_steps=0, callbacks=[callback], max_epochs=3).fit(
            net, DataLoader(lit.data(20, seed=3), batch_size=4)
        )
    assert len(net.records) == 3
    for m in net.model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert callback.psm is None


def test_lightning_dpsgd_without_noise_every_step(tmp_path: Path) -> None:
    """``DPSGD`` with a Poisson loader (q = 1/4 of 16 samples, 2 micro-batches per step), sigma = 0, 16 steps:
    ``.grad = sum_i clip(g_i) / (q N)`` over the step's micro-batches, empty ones included."""
    from pergrad.integrations.lightning import DPSGD, poisson_loader

    lit, net = lightning_net()
    net.train_dataloader = lambda: poisson_loader(  # type: ignore[method-assign]
        lit.data(16, seed=4), 0.25, trainer=net.trainer, generator=torch.Generator().manual_seed(5)
    )
    callback = DPSGD("model", max_grad_norm=BOUND, noise_multiplier=0.0, delta=1e-5, log_epsilon=None)
    lit.trainer(tmp_path, num_sanity_val_steps=0, callbacks=[callback], max_epochs=4, accumulate_grad_batches=2).fit(
        net
    )
    assert len(net.records) == 16
    sizes = []
    for step, record in enumerate(net.records):
        ref = at_params(net.model, record["params"])
        expected = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
        for x, y in record["micro"]:
            sizes.append(len(x))
            if len(x):
                for n, v in clipped_mean(one_at_a_time(ref, x, y, cross_entropy_each), [trainable(ref)]).items():
                    expected[n] += v * len(x) / 4
        for n, got in record["grad"].items():
            close(got, expected[n], f"step {step} {n}")
    assert 0 in sizes and max(sizes) >= 3, sizes


# -- HuggingFace Trainer -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "few"), [("bert", LIBRARY_FEW_FLOPS), ("bert", 0), ("gpt2", LIBRARY_FEW_FLOPS)])
def test_hf_trainer_clipped_with_adamw_and_weight_decay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str, few: int
) -> None:
    """``PerSampleTrainer`` with clipping, AdamW and weight decay, 2 micro-batches per step, 8 steps over 13 samples:
    every Linear of the tiny BERT and GPT-2 (whose head is tied to its embedding) is under 2**22 flops, so every
    covered Linear's weight stays attached (at a threshold of 0 they run detached from the second backward); each step's
    ``.grad`` is the mean of each sample's own clipped gradient."""
    pytest.importorskip("transformers")
    from tests import test_hf_trainer as hf

    monkeypatch.setattr(detach, "FEW_FLOPS", few)
    detached: list[int] = []  # the Linears' weights detached at each micro-batch
    others: set[str] = set()

    class Counting(hf.Recording):
        def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Tensor:
            loss = super().training_step(model, inputs, num_items_in_batch)
            current = self.psm._engine.detacher.current
            detached.append(sum(isinstance(m, nn.Linear) and m.weight in current for m in model.modules()))
            others.update(n for n, p in model.named_parameters() if p in current)
            return loss

    base = hf.bert() if model == "bert" else hf.gpt2()
    data = hf.class_data(13) if model == "bert" else hf.lm_data(13)
    own = hf.class_sample if model == "bert" else hf.lm_sample
    clip = 1.2 if model == "bert" else hf.LM_CLIP
    args = hf.arguments(tmp_path, max_steps=8, optim="adamw_torch", weight_decay=0.1, learning_rate=1e-3)
    recorder, _ = hf.run(
        copy.deepcopy(base),
        data,
        tmp_path,
        trainer_cls=Counting,
        args=args,
        transforms={"": transforms.clip_norm(clip)},
    )
    assert len(recorder.steps) == 8
    if few:
        assert not any(detached), detached
    else:
        assert detached[0] == 0 and all(detached[1:]), detached
    # (embeddings, LayerNorms and GPT-2's Conv1D run detached whatever their flops: the threshold is a Linear's)
    assert any("LayerNorm" in n or "ln_" in n for n in others), others
    for k, step in enumerate(recorder.steps):
        expected = hf.reference(base, step, own, clip)
        for n, g in expected.items():
            torch.testing.assert_close(step["grads"][n], g, rtol=1e-9, atol=1e-9, msg=f"step {k} .grad of {n}")


# -- Opacus's no_op route --------------------------------------------------------------------------------------


@pytest.mark.parametrize("few", [0, LIBRARY_FEW_FLOPS])
def test_opacus_no_op_route_with_a_small_projection_on_17_positions(monkeypatch: pytest.MonkeyPatch, few: int) -> None:
    """``keep_grad_sample=True`` and Opacus's ``make_private(grad_sample_mode="no_op")``: the projection (8x8 on 17
    positions) runs detached from step 2 at a threshold of 0 and stays attached at the library's; 20 Poisson steps,
    each ``.grad`` after Opacus's clipping equal to torch.func's, clipped as Opacus clips."""
    pytest.importorskip("opacus")
    from tests import test_opacus_route as route

    monkeypatch.setattr(detach, "FEW_FLOPS", few)
    model = route.tokens()
    psm = PerSampleModule(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped, optimizer, loader, _ = route.private(model, "no_op", "tokens", 4)
    reference = route.Reference(route.tokens, optimizer.expected_batch_size, "mean")
    sides = set()
    for step, x, y in route.steps(loader, 20):
        optimizer.zero_grad()
        out = wrapped(x)
        sides.add("proj.weight" in detached_names(psm, model))
        route.loss_of(out, y, "mean").backward()
        optimizer.step()
        want = reference.grads(x, y)
        route.check(model, want, f"step {step}")
        reference.step(want)
    assert sides == ({False} if few else {False, True}), sides
    psm.remove()

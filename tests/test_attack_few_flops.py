"""An adversarial review of ``detach.FEW_FLOPS``: small layers' weights stay attached, large ones run detached.

Every test runs with the library's threshold (or one chosen to put layers on both sides), several steps in
float64, and compares ``.grad`` (and ``grad_sample`` and the per-sample norms where kept) at every step with a
one-sample-at-a-time autograd loop on a ``copy.deepcopy`` of the model: the clipped mean
``(1/B) sum_i min(1, C/||g_i||) g_i``, the norm over every parameter the transform covers.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pergrad import HookStateError, PerSampleModule, transforms
from pergrad._core.shortcuts import detach
from tests.conftest import LIBRARY_FEW_FLOPS

pytestmark = pytest.mark.usefixtures("float64")

BOUND = 0.7
LR = 0.05
Batch = tuple[Tensor, Tensor]
Loss = Callable[[Tensor, Tensor], Tensor]


def squared(out: Tensor, target: Tensor) -> Tensor:
    """Each sample's own loss, ``[B]``."""
    return (out - target).pow(2).flatten(1).sum(1)


@pytest.fixture(autouse=True)
def library_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's own threshold (the suite's fixture sets 0); a test sets another where it says so."""
    monkeypatch.setattr(detach, "FEW_FLOPS", LIBRARY_FEW_FLOPS)


def one_at_a_time(model: nn.Module, x: Tensor, target: Tensor, loss: Loss = squared) -> dict[str, Tensor]:
    """``{name: [B, *p.shape]}``: each sample's gradient of its own loss, by autograd on a deep copy, one sample
    per backward (a parameter a sample does not reach gets zeros)."""
    ref = copy.deepcopy(model)
    params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    rows: list[dict[str, Tensor]] = []
    for i in range(x.shape[0]):
        ref.zero_grad()
        loss(ref(x[i : i + 1].detach().requires_grad_(x.requires_grad)), target[i : i + 1]).sum().backward()
        rows.append({n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in params.items()})
    if not rows:  # an empty batch
        return {n: p.new_zeros((0, *p.shape)) for n, p in params.items()}
    return {n: torch.stack([r[n] for r in rows]) for n in params}


def clipped_mean(ref: dict[str, Tensor], groups: Sequence[Iterable[str]], bound: float = BOUND) -> dict[str, Tensor]:
    """``(1/B) sum_i min(1, C/||g_i||) g_i`` per group of names (the norm over the group), the plain mean for the
    names no group holds."""
    out = {n: g.sum(0) / max(g.shape[0], 1) for n, g in ref.items()}  # (an empty batch: 0, as autograd's)
    for group in groups:
        names = list(group)
        norms = torch.stack([ref[n].flatten(1).square().sum(1) for n in names]).sum(0).sqrt()
        factor = (bound / norms).clamp(max=1)
        for n in names:
            out[n] = (ref[n] * factor.view(-1, *([1] * (ref[n].dim() - 1)))).sum(0) / max(ref[n].shape[0], 1)
    return out


def close(actual: Tensor | None, expected: Tensor, what: str) -> None:
    assert actual is not None, f"{what}: None"
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-11, msg=lambda m: f"{what}: {m}")


def detached_names(psm: PerSampleModule, model: nn.Module) -> set[str]:
    current = psm._engine.detacher.current
    return {n for n, p in model.named_parameters() if p in current}


def sgd(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(LR * p.grad)


def train(
    model: nn.Module,
    batches: Sequence[Batch],
    *,
    groups: Callable[[nn.Module], Sequence[Iterable[str]]] | None = None,
    wrap: dict[str, Any] | None = None,
    register: Callable[[PerSampleModule, nn.Module], None] | None = None,
    forward: Callable[[PerSampleModule], Callable[[Tensor], Tensor]] | None = None,
    before: Callable[[int, PerSampleModule, nn.Module], None] | None = None,
    loss: Loss = squared,
) -> list[set[str]]:
    """Steps of SGD through the wrapper, each checked against ``one_at_a_time``: ``.grad``, ``grad_sample`` (kept)
    and the per-sample norms (tracked). ``groups`` gives the names each clipping target covers (default: the whole
    model's trainable parameters, clipped at the root). Returns which parameters ran detached at each step."""
    options = {"keep_grad_sample": False, "track_norms": True, **(wrap or {})}
    psm = PerSampleModule(model, **options)
    if register is None:
        psm.register_transform(model, transforms.clip_norm(BOUND))
    else:
        register(psm, model)
    run = psm if forward is None else forward(psm)
    sides: list[set[str]] = []
    for step, (x, target) in enumerate(batches):
        if before is not None:
            before(step, psm, model)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        ref = one_at_a_time(model, x, target, loss)
        expected = clipped_mean(ref, [names] if groups is None else groups(model))
        psm.zero_grad()
        out = run(x)
        sides.append(detached_names(psm, model))
        loss(out, target).mean().backward()
        norms = psm.per_sample_norms() if options["track_norms"] else {}
        for name, p in model.named_parameters():
            if not p.requires_grad:
                assert p.grad is None, f"step {step} {name}: frozen, has a .grad"
                continue
            close(p.grad, expected[name], f"step {step} (B={x.shape[0]}) .grad of {name}")
            if options["keep_grad_sample"]:
                close(p.grad_sample, ref[name], f"step {step} grad_sample of {name}")
            if name in norms:
                close(norms[name], ref[name].flatten(1).norm(dim=1), f"step {step} norms of {name}")
        sgd(model)
    psm.remove()
    return sides


def gen_batches(shapes: Sequence[tuple[int, ...]], out: Callable[[tuple[int, ...]], tuple[int, ...]]) -> list[Batch]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=g), torch.randn(out(s), generator=g)) for s in shapes]


# -- a large layer that crosses 2**22 flops as the batch changes ---------------------------------------------------


class Wide(nn.Module):
    """A small Linear (8x4: always attached), a wide one (256x256: ``2 B L 65536`` flops, at least 2**22 from
    ``B L = 32``), a small head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 256)
        self.wide = nn.Linear(256, 256)
        self.head = nn.Linear(256, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.wide(torch.tanh(self.inp(x)) / 4)
        return self.head(torch.tanh(h)).flatten(1)


WIDE_BATCHES = [31, 32, 33, 31, 64, 16, 32, 2]  # B L: both sides of 32, and exactly at it


def test_a_wide_layer_crosses_the_library_threshold_back_and_forth() -> None:
    torch.manual_seed(0)
    model = Wide()
    sides = train(model, gen_batches([(b, 4) for b in WIDE_BATCHES], lambda s: (s[0], 2)))
    for step, (b, found) in enumerate(zip(WIDE_BATCHES, sides)):
        # inp (1024 weights) and head (512) are at most 2*64*1024 = 131k flops: attached
        should = set() if step == 0 or b < 32 else {"wide.weight"}
        assert found == should, f"step {step} (B={b}): {found}"


def test_a_wide_layer_on_sequences_crosses_it_by_the_positions() -> None:
    """B L crosses 32 through L at a fixed batch; with kept ``grad_sample`` the weight is detached from 16
    positions only where it is also expensive."""
    torch.manual_seed(1)
    shapes = [(2, 15, 4), (2, 16, 4), (2, 17, 4), (1, 16, 4), (2, 8, 4), (3, 16, 4)]
    sides = train(Wide(), gen_batches(shapes, lambda s: (s[0], s[1] * 2)), wrap={"keep_grad_sample": True})
    for step, ((b, t, _), found) in enumerate(zip(shapes, sides)):
        assert ("wide.weight" in found) == (step > 0 and b * t >= 32), f"step {step}: {found}"


@pytest.mark.parametrize("keep", [False, True])
def test_only_some_layers_transformed_mixing_attached_and_detached(keep: bool) -> None:
    """Clipping per module covers wide (detached when large) and inp (small: attached); head has no transform."""
    torch.manual_seed(2)

    def register(psm: PerSampleModule, model: nn.Module) -> None:
        psm.register_transform("wide", transforms.clip_norm(BOUND))
        psm.register_transform("inp", transforms.clip_norm(BOUND / 3))

    def groups(model: nn.Module) -> list[list[str]]:
        return [["wide.weight", "wide.bias"]]

    batches = gen_batches([(b, 4) for b in WIDE_BATCHES], lambda s: (s[0], 2))
    torch.manual_seed(2)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=keep)
    register(psm, model)
    seen = set()
    for step, (x, t) in enumerate(batches):
        ref = one_at_a_time(model, x, t)
        expected = clipped_mean(ref, groups(model))
        inp = clipped_mean(ref, [["inp.weight", "inp.bias"]], BOUND / 3)
        expected.update({n: inp[n] for n in ("inp.weight", "inp.bias")})
        psm.zero_grad()
        out = psm(x)
        seen.add(frozenset(detached_names(psm, model)))
        squared(out, t).mean().backward()
        for name, p in model.named_parameters():
            close(p.grad, expected[name], f"step {step} {name}")
            if keep:
                close(p.grad_sample, ref[name], f"step {step} grad_sample {name}")
        sgd(model)
    assert frozenset() in seen and any("wide.weight" in s for s in seen), seen
    assert not any("inp.weight" in s or "head.weight" in s for s in seen), seen


# -- small models at a threshold that puts their layers on both sides -----------------------------------------------


class Convs(nn.Module):
    """conv1d (2->3, k3: 18 weights at L positions) then conv2d (3->4, 3x3: 108 weights) and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(2, 3, 3, padding=1)
        self.c2 = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.c1(x))  # [B, 3, L]
        h = torch.tanh(self.c2(h.unsqueeze(1)))  # [B, 4, 3, L]
        return self.head(h.mean((2, 3)))


def conv_costs(b: int, length: int) -> dict[str, int]:
    return {"c1.weight": 2 * b * length * 18, "c2.weight": 2 * b * 3 * length * 36 * 1, "head.weight": 2 * b * 8}


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("few", [2 * 4 * 6 * 36 * 3, LIBRARY_FEW_FLOPS])  # (the first: c2's flops at B=4, L=6)
def test_convolutions_run_detached_whatever_their_flops(monkeypatch: pytest.MonkeyPatch, keep: bool, few: int) -> None:
    """The threshold is a Linear's alone (a convolution's weight gradient costs the host more than its flops say):
    covered convolutions run detached from the second step at every batch and length, and every step is exact."""
    monkeypatch.setattr(detach, "FEW_FLOPS", few)
    torch.manual_seed(3)
    shapes = [(4, 2, 6), (4, 2, 6), (3, 2, 6), (4, 2, 5), (8, 2, 17), (2, 2, 16), (4, 2, 6)]
    sides = train(Convs(), gen_batches(shapes, lambda s: (s[0], 2)), wrap={"keep_grad_sample": keep})
    for step, found in enumerate(sides):
        should = {"c1.weight", "c1.bias", "c2.weight", "c2.bias"} if step > 0 else set()
        assert found == should, f"step {step}: {found}"


class Twice(nn.Module):
    """One Linear called twice per forward: on a short view and then on a long sequence (``order`` swaps them)."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.order = order
        self.inp = nn.Linear(3, 16)
        self.lin = nn.Linear(16, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))  # [B, T, 16]
        short, long = h[:, :1], h
        if self.order == "short first":
            a, b = self.lin(short).mean(1), self.lin(long).mean(1)
        else:
            b, a = self.lin(long).mean(1), self.lin(short).mean(1)
        return self.head(torch.tanh(a) * torch.tanh(b))


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("order", ["short first", "long first"])
def test_a_layer_called_twice_with_different_positions_decides_at_its_first_call(
    monkeypatch: pytest.MonkeyPatch, order: str, keep: bool
) -> None:
    few = 2 * 4 * 256 * 8  # lin (256 weights): cheap on 1 position, expensive on 8+ at B=4
    monkeypatch.setattr(detach, "FEW_FLOPS", few)
    torch.manual_seed(4)
    shapes = [(4, 8, 3), (4, 8, 3), (4, 20, 3), (3, 8, 3), (5, 16, 3), (4, 1, 3)]
    sides = train(Twice(order), gen_batches(shapes, lambda s: (s[0], 2)), wrap={"keep_grad_sample": keep})
    for step, ((b, t, _), found) in enumerate(zip(shapes, sides)):
        first = 1 if order == "short first" else t
        assert ("lin.weight" in found) == (step > 0 and 2 * b * first * 256 >= few), f"step {step}: {found}"


class Tied(nn.Module):
    """An embedding whose weight the output layer reuses, and a small Linear between."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: Tensor) -> Tensor:
        return self.out(torch.tanh(self.mid(self.emb(idx))))


def token_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(target.shape).sum(1)


def tokens(shapes: Sequence[tuple[int, int]]) -> list[Batch]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(11, s, generator=g), torch.randint(11, s, generator=g)) for s in shapes]


@pytest.mark.parametrize("few", [0, 2 * 3 * 16 * 64, LIBRARY_FEW_FLOPS])
def test_tied_weights_and_a_small_linear_on_sequences(monkeypatch: pytest.MonkeyPatch, few: int) -> None:
    monkeypatch.setattr(detach, "FEW_FLOPS", few)
    torch.manual_seed(6)
    shapes = [(3, 16), (3, 16), (2, 15), (4, 17), (3, 16), (1, 40)]
    sides = train(Tied(), tokens(shapes), loss=token_loss, wrap={"keep_grad_sample": True})
    for step, ((b, t), found) in enumerate(zip(shapes, sides)):
        assert "emb.weight" not in found
        assert ("mid.weight" in found) == (step > 0 and 2 * b * t * 64 >= few), f"step {step}: {found}"


@pytest.mark.parametrize("late", ["inp.weight", "wide.weight", "head.bias"])
def test_a_regulariser_switched_on_later_is_refused_naming_the_parameter(late: str) -> None:
    """A term on a covered parameter that is not per-sample (``0.1 * p.sum()``) cannot be clipped: the backward
    raises, naming it, whether the weight ran attached (small) or detached (wide at B=64); .grad stays as it was."""
    torch.manual_seed(7)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    params = dict(model.named_parameters())
    for step, (x, t) in enumerate(gen_batches([(64, 4), (64, 4), (8, 4), (64, 4), (8, 4)], lambda s: (s[0], 2))):
        psm.zero_grad(set_to_none=False)
        loss = squared(psm(x), t).mean()
        if step < 3:
            loss.backward()
            sgd(model)
            continue
        before = {n: p.grad.clone() for n, p in params.items()}
        with pytest.raises(HookStateError, match=re.escape(f"parameter '{late}'")):
            (loss + 0.1 * params[late].sum()).backward()
        for n, p in params.items():
            assert torch.equal(p.grad, before[n]), f"step {step}: {n} half-written"
    psm.remove()


def test_without_verify_small_weights_run_detached_and_a_regulariser_is_still_refused() -> None:
    """With ``verify=False`` no tap checks what reaches an attached weight, so the threshold does not apply: the small
    weight runs detached from the first step, as before it, and a term on it is refused naming it, never dropped."""
    torch.manual_seed(7)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=False, verify=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    params = dict(model.named_parameters())
    for step, (x, t) in enumerate(gen_batches([(8, 4), (8, 4), (8, 4)], lambda s: (s[0], 2))):
        psm.zero_grad()
        out = psm(x)
        assert model.inp.weight in psm._engine.detacher.current, f"step {step}"
        loss = squared(out, t).mean()
        if step < 2:
            expected = clipped_mean(one_at_a_time(model, x, t), [params])
            loss.backward()
            for n, p in params.items():
                close(p.grad, expected[n], f"step {step} {n}")
            continue
        with pytest.raises(HookStateError, match=re.escape("parameter 'inp.weight'")):
            (loss + 0.1 * params["inp.weight"].sum()).backward()
    psm.remove()


# -- the user's hooks on small attached weights ----------------------------------------------------------------


def test_tensor_hooks_see_autograds_gradient_and_grad_is_clipped() -> None:
    """``p.register_hook`` on the small inp.weight and the wide weight: each hook gets autograd's (untransformed)
    gradient of the batch once per backward; .grad is the clipped mean."""
    torch.manual_seed(8)
    model = Wide()
    seen: dict[str, list[Tensor]] = {"inp.weight": [], "wide.weight": []}
    for name in seen:
        model.get_parameter(name).register_hook(lambda g, name=name: seen[name].append(g.clone()))
    batches = gen_batches([(b, 4) for b in WIDE_BATCHES], lambda s: (s[0], 2))
    refs: list[dict[str, Tensor]] = []

    def before(step: int, psm: PerSampleModule, model: nn.Module) -> None:
        refs.append(one_at_a_time(model, *batches[step]))

    train(model, batches, before=before)
    for name, got in seen.items():
        assert len(got) == len(batches), name
        for step, g in enumerate(got):
            close(g, refs[step][name].mean(0), f"step {step}: hooked gradient of {name}")


def test_an_optimizer_in_backward_on_small_and_wide_weights() -> None:
    """Post-accumulate-grad hooks step each parameter's own SGD from its final (clipped) .grad, then clear it:
    the same parameters as stepping after the backward, step after step while wide crosses the threshold."""
    batches = gen_batches([(b, 4) for b in WIDE_BATCHES], lambda s: (s[0], 2))
    torch.manual_seed(9)
    model = Wide()
    plain = copy.deepcopy(model)
    seen: dict[str, list[Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():

        def step(q: Tensor, name: str = name) -> None:
            assert q.grad is not None
            seen[name].append(q.grad.clone())
            with torch.no_grad():
                q.sub_(LR * q.grad)
            q.grad = None

        p.register_post_accumulate_grad_hook(step)
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    for step_, (x, t) in enumerate(batches):
        expected = clipped_mean(one_at_a_time(plain, x, t), [[n for n, _ in plain.named_parameters()]])
        squared(psm(x), t).mean().backward()
        for name, p in plain.named_parameters():
            assert len(seen[name]) == step_ + 1, f"step {step_}: the hook on {name} ran {len(seen[name])} times"
            close(seen[name][-1], expected[name], f"step {step_}: .grad of {name} in its hook")
            with torch.no_grad():
                p.sub_(LR * expected[name])
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            close(p.detach(), q.detach(), f"step {step_}: {name} after the step")
            assert p.grad is None
    psm.remove()


# -- micro-batches, scales --------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["backward", "samples"])
def test_micro_batches_accumulated_across_the_threshold(how: str) -> None:
    """Two micro-batches per step, of sizes on both sides of 32 for the wide layer, ``.grad`` kept
    (``zero_grad(set_to_none=False)``): each backward adds its own clipped mean (``backward``), or ``.grad`` is the
    clipped mean over every sample since the clear (``samples``)."""
    torch.manual_seed(10)
    model = Wide()
    names = [n for n, _ in model.named_parameters()]
    psm = PerSampleModule(model, keep_grad_sample=False, accumulate=how)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    splits = [(40, 8), (8, 40), (32, 31), (31, 32), (64, 2), (3, 5)]
    g = torch.Generator().manual_seed(11)
    sides = set()
    for step, sizes in enumerate(splits):
        parts = [(torch.randn(b, 4, generator=g), torch.randn(b, 2, generator=g)) for b in sizes]
        refs = [one_at_a_time(model, x, t) for x, t in parts]
        if how == "backward":
            expected = {n: sum(clipped_mean(r, [names])[n] for r in refs) for n in names}
        else:
            whole = {n: torch.cat([r[n] for r in refs]) for n in names}
            expected = clipped_mean(whole, [names])
        psm.zero_grad(set_to_none=False)
        for x, t in parts:
            out = psm(x)
            sides.add("wide.weight" in detached_names(psm, model))
            squared(out, t).mean().backward()
        for name, p in model.named_parameters():
            close(p.grad, expected[name], f"step {step} {sizes} {name}")
        sgd(model)
    assert sides == {True, False}
    psm.remove()


@pytest.mark.parametrize("scaler", [False, True])
def test_loss_scale_and_grad_scaler(scaler: bool) -> None:
    """``loss_scale=1/2`` over two micro-batches, and a GradScaler's scaled loss (unscaled before the check)."""
    torch.manual_seed(12)
    model = Wide()
    names = [n for n, _ in model.named_parameters()]
    amp = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaler else None
    psm = PerSampleModule(model, keep_grad_sample=True, loss_scale=0.5, grad_scaler=amp)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(13)
    for step, sizes in enumerate([(40, 8), (33, 31), (64, 64), (2, 3), (32, 32), (31, 33)]):
        parts = [(torch.randn(b, 4, generator=g), torch.randn(b, 2, generator=g)) for b in sizes]
        refs = [one_at_a_time(model, x, t) for x, t in parts]
        expected = {n: sum(clipped_mean(r, [names])[n] for r in refs) / 2 for n in names}
        opt.zero_grad()
        for x, t in parts:
            loss = squared(psm(x), t).mean() / 2
            (loss if amp is None else amp.scale(loss)).backward()
        norms = psm.per_sample_norms()
        for name in names:
            close(norms[name], refs[1][name].flatten(1).norm(dim=1), f"step {step} norms of {name}")
        if amp is not None:
            amp.unscale_(opt)
        for name, p in model.named_parameters():
            close(p.grad, expected[name], f"step {step} {name}")
        if amp is None:
            opt.step()
        else:
            amp.step(opt)
            amp.update()
    psm.remove()


# -- precision, checkpointing, compile ----------------------------------------------------------------------------


def test_autocast_bf16_attached_and_detached_agree() -> None:
    """Under CPU autocast (bf16 matmuls), the library threshold's run (wide on both sides) gives the .grad of a run
    with every covered weight detached and of one with none, and the one-sample reference to bf16's precision."""
    batches = gen_batches([(b, 4) for b in WIDE_BATCHES[:6]], lambda s: (s[0], 2))
    runs: dict[str, list[dict[str, Tensor]]] = {}
    for label, few, detaching in [("library", LIBRARY_FEW_FLOPS, True), ("all", 0, True), ("none", 0, False)]:
        detach.FEW_FLOPS = few
        torch.manual_seed(14)
        model = Wide()
        psm = PerSampleModule(model, keep_grad_sample=False, detach_transformed=detaching)
        psm.register_transform(model, transforms.clip_norm(BOUND))
        grads = []
        for x, t in batches:
            psm.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = psm(x)
            squared(out.double(), t).mean().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            sgd(model)
        psm.remove()
        runs[label] = grads
    detach.FEW_FLOPS = LIBRARY_FEW_FLOPS
    for step in range(len(batches)):
        for name, g in runs["library"][step].items():
            for other in ("all", "none"):
                torch.testing.assert_close(
                    g, runs[other][step][name], rtol=1e-6, atol=1e-9, msg=f"{step} {name} {other}"
                )
    torch.manual_seed(14)
    model = Wide()
    names = [n for n, _ in model.named_parameters()]
    for step, (x, t) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = one_at_a_time(model, x, t, lambda o, tt: squared(o.double(), tt))
        expected = clipped_mean(ref, [names])
        for name in names:
            got = runs["library"][step][name]
            scale = expected[name].abs().max()
            torch.testing.assert_close(got, expected[name], rtol=0.05, atol=0.05 * scale, msg=f"{step} {name}")
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.sub_(LR * runs["library"][step][n])


class Checkpointed(nn.Module):
    """inp and head outside, a block (the wide Linear and a small one) under activation checkpointing."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(4, 256)
        self.wide = nn.Linear(256, 256)
        self.small = nn.Linear(256, 4)
        self.head = nn.Linear(4, 2)

    def block(self, h: Tensor) -> Tensor:
        return torch.tanh(self.small(torch.tanh(self.wide(h))))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x)) / 4
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_across_the_threshold(reentrant: bool) -> None:
    torch.manual_seed(15)
    shapes = [(b, 4) for b in WIDE_BATCHES]
    if reentrant:  # (the reentrant checkpoint needs an input that requires grad to run its backward)
        batches = [(x.requires_grad_(True), t) for x, t in gen_batches(shapes, lambda s: (s[0], 2))]
    else:
        batches = gen_batches(shapes, lambda s: (s[0], 2))
    sides = train(Checkpointed(reentrant), batches, wrap={"keep_grad_sample": True})
    if not reentrant:  # (the reentrant one runs the block under no_grad and again in the backward)
        assert any("wide.weight" in s for s in sides) and any("wide.weight" not in s for s in sides[1:]), sides


@pytest.fixture
def dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("dynamo")
def test_compiled_with_changing_shapes() -> None:
    torch.manual_seed(16)
    shapes = [(2, 15, 4), (2, 16, 4), (3, 17, 4), (1, 16, 4), (4, 8, 4), (3, 16, 4)]
    train(
        Wide(),
        gen_batches(shapes, lambda s: (s[0], s[1] * 2)),
        wrap={"keep_grad_sample": True},
        forward=lambda psm: torch.compile(psm, backend="aot_eager"),
    )


@pytest.mark.usefixtures("dynamo")
def test_compiled_with_fullgraph_is_refused_naming_pergrad_and_fullgraph() -> None:
    torch.manual_seed(17)
    with pytest.raises(Exception) as err:
        train(
            Wide(),
            gen_batches([(33, 4), (31, 4)], lambda s: (s[0], 2)),
            forward=lambda psm: torch.compile(psm, backend="aot_eager", fullgraph=True),
        )
    message = str(err.value)
    assert "pergrad" in message and "fullgraph" in message, message[:800]
    assert "reason: None" not in message, message[:800]


# -- the model's layout changed between steps ------------------------------------------------------------------


def test_converted_reloaded_and_frozen_between_steps() -> None:
    """``.float().double()`` (new data), ``load_state_dict(assign=True)`` (new Parameters), ``requires_grad_(False)``
    on inp and back, while wide crosses the threshold."""
    torch.manual_seed(18)
    batches = gen_batches([(b, 4) for b in [33, 31, 64, 8, 40, 32, 31, 64]], lambda s: (s[0], 2))

    def before(step: int, psm: PerSampleModule, model: nn.Module) -> None:
        if step == 2:
            model.float().double()
        if step == 3:
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        if step == 5:
            model.get_submodule("inp").requires_grad_(False)
            for p in model.get_submodule("inp").parameters():
                p.grad = None
        if step == 7:
            model.get_submodule("inp").requires_grad_(True)

    sides = train(Wide(), batches, before=before)
    assert sides[2] == {"wide.weight"} and sides[3] == set() and sides[4] == {"wide.weight"}, sides


def test_a_lazy_linear_wrapped_before_its_first_forward() -> None:
    torch.manual_seed(19)
    model = nn.Sequential(nn.LazyLinear(256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.LazyLinear(2))
    batches = gen_batches([(b, 4) for b in WIDE_BATCHES], lambda s: (s[0], 2))
    # (the reference needs the initialized model: one forward of the wrapped model materializes it)
    psm = PerSampleModule(model, keep_grad_sample=True)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    names: list[str] = []
    for step, (x, t) in enumerate(batches):
        if step == 0:
            out = psm(x)  # the first forward initializes the lazy layers: the reference is taken after it
            names = [n for n, _ in model.named_parameters()]
            ref = one_at_a_time(model, x, t)
        else:
            ref = one_at_a_time(model, x, t)
            psm.zero_grad()
            out = psm(x)
        found = detached_names(psm, model)
        assert ("2.weight" in found) == (step > 0 and x.shape[0] >= 32), f"step {step}: {found}"
        squared(out, t).mean().backward()
        expected = clipped_mean(ref, [names])
        for name, p in model.named_parameters():
            close(p.grad, expected[name], f"step {step} {name}")
            close(p.grad_sample, ref[name], f"step {step} grad_sample {name}")
        sgd(model)
    psm.remove()


def test_eval_batches_under_no_grad_between_steps() -> None:
    torch.manual_seed(20)
    g = torch.Generator().manual_seed(21)

    def before(step: int, psm: PerSampleModule, model: nn.Module) -> None:
        psm.eval()
        with torch.no_grad():
            for b in (100, 1, 33):
                psm(torch.randn(b, 4, generator=g))
        psm.train()

    sides = train(Wide(), gen_batches([(b, 4) for b in WIDE_BATCHES], lambda s: (s[0], 2)), before=before)
    assert sides[1:] == [{"wide.weight"} if b >= 32 else set() for b in WIDE_BATCHES[1:]], sides


class Block(nn.Module):
    """A pre-norm transformer block: embedding, attention (``nn.MultiheadAttention``), a feed-forward pair of
    Linears (32x64 each: 4096 weights, ``2 B T 4096`` flops) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 32)
        self.norm1 = nn.LayerNorm(32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.norm2 = nn.LayerNorm(32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.head = nn.Linear(32, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        n = self.norm1(h)
        h = h + self.attn(n, n, n, need_weights=False)[0]
        h = h + self.down(F.gelu(self.up(self.norm2(h))))
        return self.head(h.mean(1))


@pytest.mark.parametrize("keep", [False, True])
def test_a_transformer_block_with_its_feed_forward_on_both_sides(monkeypatch: pytest.MonkeyPatch, keep: bool) -> None:
    few = 2 * 2 * 16 * 2048  # up/down (2048 weights): detached from B T = 32
    monkeypatch.setattr(detach, "FEW_FLOPS", few)
    torch.manual_seed(22)
    shapes = [(2, 16, 3), (2, 16, 3), (2, 15, 3), (3, 17, 3), (1, 16, 3), (4, 8, 3), (2, 20, 3)]
    sides = train(Block(), gen_batches(shapes, lambda s: (s[0], 2)), wrap={"keep_grad_sample": keep})
    for step, ((b, t, _), found) in enumerate(zip(shapes, sides)):
        ff = {"up.weight", "up.bias", "down.weight", "down.bias"} & found
        assert bool(ff) == (step > 0 and 2 * b * t * 2048 >= few), f"step {step}: {found}"


# -- more of a user's loop -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("lean", [False, True])
def test_empty_and_lean_forwards_across_the_threshold(lean: bool) -> None:
    """An empty batch between steps (``.grad`` 0), and lean forwards (``lean_forwards=True``)."""
    torch.manual_seed(23)
    sizes = [33, 31, 0, 64, 0, 32, 31, 33]
    sides = train(Wide(), gen_batches([(b, 4) for b in sizes], lambda s: (s[0], 2)), wrap={"lean_forwards": lean})
    assert sides[3] == {"wide.weight"} and sides[6] == set(), sides


def test_autograd_grad_of_a_small_attached_weight_leaves_grad_alone() -> None:
    """``torch.autograd.grad`` with respect to a small (attached) covered weight gives autograd's batch gradient and
    leaves ``.grad`` alone; the wide one, detached at B=64, is refused naming the layer; the steps stay exact."""
    torch.manual_seed(24)
    batches = gen_batches([(b, 4) for b in [33, 31, 64, 8, 64, 40]], lambda s: (s[0], 2))

    def before(step: int, psm: PerSampleModule, model: nn.Module) -> None:
        x, t = batches[step]
        ref = one_at_a_time(model, x, t)
        for name in ("inp.weight", "head.bias", "wide.weight"):
            p = model.get_parameter(name)
            grads_before = {n: None if q.grad is None else q.grad.clone() for n, q in model.named_parameters()}
            loss = squared(psm(x), t).mean()
            if name == "wide.weight" and step > 0 and x.shape[0] >= 32:
                with pytest.raises(detach.DetachedWeightError, match=r"weight of .*wide"):
                    torch.autograd.grad(loss, [p])
            else:
                (g,) = torch.autograd.grad(loss, [p])
                close(g, ref[name].mean(0), f"step {step} autograd.grad of {name}")
            for n, q in model.named_parameters():
                assert (q.grad is None and grads_before[n] is None) or torch.equal(q.grad, grads_before[n]), n

    train(Wide(), batches, before=before)


def test_two_backwards_of_one_forward_add_up() -> None:
    """``retain_graph=True``: two losses of one forward, no transform, grad_sample kept, a layer on sequences of
    16+ positions (detached when expensive) and small ones (attached): .grad and grad_sample are the sums."""
    torch.manual_seed(25)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=True)
    g = torch.Generator().manual_seed(26)
    sides = set()
    for step, (b, t) in enumerate([(2, 16), (2, 16), (1, 16), (3, 17), (2, 15), (1, 40)]):
        x, y = torch.randn(b, t, 4, generator=g), torch.randn(b, t * 2, generator=g)

        def second(out: Tensor, target: Tensor) -> Tensor:
            return out.pow(3).flatten(1).sum(1) * 0.1

        r1, r2 = one_at_a_time(model, x, y), one_at_a_time(model, x, y, second)
        psm.zero_grad()
        out = psm(x)
        sides.add("wide.weight" in detached_names(psm, model))
        squared(out, y).mean().backward(retain_graph=True)
        second(out, y).mean().backward()
        for name, p in model.named_parameters():
            close(p.grad, r1[name].mean(0) + r2[name].mean(0), f"step {step} {name}")
            close(p.grad_sample, r1[name] + r2[name], f"step {step} grad_sample {name}")
        sgd(model)
    assert sides == {True, False}, sides
    psm.remove()


class SeqFirst(nn.Module):
    """A batch_first=False model: [T, B, 4] -> the wide Linear on every position -> [B, 2]."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 256)
        self.wide = nn.Linear(256, 256)
        self.head = nn.Linear(256, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.wide(torch.tanh(self.inp(x)) / 4))
        return self.head(h.mean(0))


def test_sequence_first_model_crosses_by_batch_times_positions() -> None:
    torch.manual_seed(27)
    g = torch.Generator().manual_seed(28)
    shapes = [(8, 4), (8, 4), (4, 7), (2, 16), (1, 31), (16, 2)]  # (T, B): B T = 32, 32, 28, 32, 31, 32
    batches = [(torch.randn(t, b, 4, generator=g), torch.randn(b, 2, generator=g)) for t, b in shapes]
    model = SeqFirst()
    psm = PerSampleModule(model, keep_grad_sample=True, batch_first=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    names = [n for n, _ in model.named_parameters()]
    for step, (x, y) in enumerate(batches):
        ref = {n.removeprefix("model."): g for n, g in one_at_a_time(_FirstBatch(model), x.transpose(0, 1), y).items()}
        expected = clipped_mean(ref, [names])
        psm.zero_grad()
        out = psm(x)
        b, t = x.shape[1], x.shape[0]
        assert ("wide.weight" in detached_names(psm, model)) == (step > 0 and b * t >= 32), f"step {step}"
        squared(out, y).mean().backward()
        for name, p in model.named_parameters():
            close(p.grad, expected[name], f"step {step} {name}")
            close(p.grad_sample, ref[name], f"step {step} grad_sample {name}")
        sgd(model)
    psm.remove()


class _FirstBatch(nn.Module):
    """``model`` called on ``x.transpose(0, 1)``: a batch-first view for the one-sample reference."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x.transpose(0, 1))


class Positional(nn.Module):
    """A Linear on an input without a batch dim (positions' features ``[T, 1]``), added to every sample."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Linear(1, 64)
        self.inp = nn.Linear(3, 64)
        self.wide = nn.Linear(64, 64)
        self.head = nn.Linear(64, 2)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        pos = self.pos(torch.linspace(0, 1, t).unsqueeze(1))  # [T, 64], shared by the batch
        h = torch.tanh(self.inp(x) + pos)
        return self.head(torch.tanh(self.wide(h)).mean(1))


@pytest.mark.parametrize("keep", [False, True])
def test_a_layer_on_an_input_shared_by_the_batch(monkeypatch: pytest.MonkeyPatch, keep: bool) -> None:
    few = 2 * 2 * 16 * 4096  # wide: detached from B T = 32
    monkeypatch.setattr(detach, "FEW_FLOPS", few)
    torch.manual_seed(29)
    shapes = [(2, 16, 3), (2, 16, 3), (2, 15, 3), (3, 17, 3), (1, 16, 3), (4, 8, 3), (2, 20, 3)]
    sides = train(Positional(), gen_batches(shapes, lambda s: (s[0], 2)), wrap={"keep_grad_sample": keep})
    assert any("wide.weight" in s for s in sides) and any("wide.weight" not in s for s in sides[1:]), sides


@pytest.mark.parametrize("keep", [False, True])
def test_statistics_of_every_step_across_the_threshold(monkeypatch: pytest.MonkeyPatch, keep: bool) -> None:
    """``track_statistics=True`` (second moments: a weight on 16+ positions runs detached where also expensive)
    and no transform: the statistics and .grad of every step."""
    from tests.test_fused import check_statistics

    few = 2 * 2 * 16 * 4096
    monkeypatch.setattr(detach, "FEW_FLOPS", few)
    torch.manual_seed(30)
    model = Positional()
    psm = PerSampleModule(model, keep_grad_sample=keep, track_statistics=True)
    sides = set()
    for step, (x, t) in enumerate(
        gen_batches([(2, 16, 3), (2, 16, 3), (2, 15, 3), (3, 17, 3), (2, 17, 3), (4, 8, 3)], lambda s: (s[0], 2))
    ):
        ref = one_at_a_time(model, x, t)
        psm.zero_grad()
        out = psm(x)
        sides.add("wide.weight" in detached_names(psm, model))
        squared(out, t).mean().backward()
        check_statistics(psm.statistics(), ref)
        for name, p in model.named_parameters():
            close(p.grad, ref[name].mean(0), f"step {step} {name}")
        sgd(model)
    assert sides == {True, False}, sides
    psm.remove()


@pytest.mark.parametrize("keep", [False, True])
def test_convolutions_with_tracked_norms_and_no_transform(monkeypatch: pytest.MonkeyPatch, keep: bool) -> None:
    few = 2 * 4 * 6 * 36 * 3
    monkeypatch.setattr(detach, "FEW_FLOPS", few)
    torch.manual_seed(31)
    shapes = [(4, 2, 6), (4, 2, 6), (3, 2, 6), (4, 2, 5), (8, 2, 17), (2, 2, 16), (4, 2, 6)]
    sides = train(
        Convs(),
        gen_batches(shapes, lambda s: (s[0], 2)),
        wrap={"keep_grad_sample": keep, "track_norms": True},
        register=lambda psm, model: None,
        groups=lambda model: [],
    )
    # each from 16 positions per sample (c2 sees 3 L), whatever the flops
    c2 = frozenset({"c2.weight", "c2.bias"})
    assert {frozenset(s) for s in sides} == {frozenset(), c2, c2 | {"c1.weight", "c1.bias"}}, sides


def test_a_submodule_replaced_between_steps() -> None:
    """``model.wide = nn.Linear(256, 256)`` after two steps: the new layer is hooked, clipped and crosses the
    threshold like the one it replaced."""
    torch.manual_seed(32)

    def before(step: int, psm: PerSampleModule, model: nn.Module) -> None:
        if step == 2:
            model.wide = nn.Linear(256, 256)

    sides = train(Wide(), gen_batches([(b, 4) for b in [33, 40, 33, 40, 31, 64]], lambda s: (s[0], 2)), before=before)
    assert sides[3] == {"wide.weight"} and sides[4] == set() and sides[5] == {"wide.weight"}, sides


@pytest.mark.usefixtures("dynamo")
def test_a_submodule_compiled_after_wrapping() -> None:
    torch.manual_seed(33)

    def before(step: int, psm: PerSampleModule, model: nn.Module) -> None:
        if step == 1:
            model.get_submodule("wide").compile(backend="aot_eager")

    train(Wide(), gen_batches([(b, 4) for b in [33, 40, 31, 64, 8, 32]], lambda s: (s[0], 2)), before=before)


def test_backward_with_inputs_naming_one_small_transformed_module() -> None:
    """``backward(inputs=[inp.weight, inp.bias])`` with clipping on ``inp`` (small: attached) while wide (no
    transform) runs with its weight attached too: only inp's .grad is written, the clipped mean; the others
    stay None. Then full steps go on exact."""
    torch.manual_seed(34)
    model = Wide()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform("inp", transforms.clip_norm(BOUND))
    g = torch.Generator().manual_seed(35)
    for step, b in enumerate([33, 40, 31, 64, 8, 32]):
        x, t = torch.randn(b, 4, generator=g), torch.randn(b, 2, generator=g)
        ref = one_at_a_time(model, x, t)
        expected = clipped_mean(ref, [["inp.weight", "inp.bias"]])
        psm.zero_grad()
        loss = squared(psm(x), t).mean()
        partial = step % 2 == 1
        loss.backward(inputs=[model.inp.weight, model.inp.bias] if partial else None)
        for name, p in model.named_parameters():
            if partial and not name.startswith("inp"):
                assert p.grad is None, f"step {step}: {name}"
            else:
                close(p.grad, expected[name], f"step {step} {name}")
        sgd(model)
    psm.remove()

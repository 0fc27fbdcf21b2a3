"""Forwards followed until they repeat, then lean (``pergrad._core.shortcuts.followed``): every step exact against
a one-sample-at-a-time autograd loop, also where a lean forward takes a path the followed ones did not take."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pergrad import PerSampleModule, transforms
from pergrad.errors import BatchSizeError
from tests.reference import assert_close, clipped_mean

pytestmark = pytest.mark.usefixtures("float64")
BOUND = 0.5
UNMATCHED = r"took a path the forwards pergrad followed with arguments of the same shapes did not take"


def loss_fn(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y)


def one_at_a_time(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """``{name: [B, *shape]}``: each sample's gradient of its own loss, by autograd on a copy of ``model``."""
    ref = copy.deepcopy(model)
    params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    grads: dict[str, list[Tensor]] = {n: [] for n in params}
    for i in range(x.shape[0]):
        found = torch.autograd.grad(loss_fn(ref(x[i : i + 1]), y[i : i + 1]), list(params.values()), allow_unused=True)
        for n, g in zip(params, found, strict=True):
            grads[n].append(torch.zeros_like(params[n]) if g is None else g)
    return {n: torch.stack(gs) for n, gs in grads.items()}


def step_and_check(psm: PerSampleModule, model: nn.Module, x: Tensor, y: Tensor, what: str) -> None:
    """One clipped step (the whole model clipped to ``BOUND``), its ``.grad`` against the reference, then SGD."""
    expected = clipped_mean(one_at_a_time(model, x, y), BOUND)
    model.zero_grad(set_to_none=True)
    loss_fn(psm(x), y).backward()
    for n, p in model.named_parameters():
        if p.grad is None:  # (a parameter this forward did not use: as plain autograd leaves it)
            assert not expected[n].any(), f"{what}: no .grad of {n}"
            continue
        assert_close(p.grad, expected[n], f"{what}: .grad of {n}")
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.1 * p.grad)


class Branchy(nn.Module):
    """``x [B, T, D]``; after its first layer, a path chosen by ``mode`` (not by the data)."""

    def __init__(self, d: int = 3, t: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.extra, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 3)
        self.pos = nn.Embedding(t, d)
        self.mode = "plain"

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        if self.mode == "extra":  # one more layer on the batch, and a residual add
            h = h + self.extra(h)
        elif self.mode == "transpose":  # the layer on a sequence-first copy: the batch on dim 1
            h = self.extra(h.transpose(0, 1).contiguous()).transpose(0, 1)
        elif self.mode == "shared":  # the layer on a tensor every sample shares (positions)
            h = h + self.extra(self.pos(torch.arange(h.shape[1])))
        return self.out(h).sum(1)


def data(b: int, t: int, d: int = 3, seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, d, generator=gen), torch.randint(0, 3, (b,), generator=gen)


def wrapped(model: nn.Module) -> PerSampleModule:
    psm = PerSampleModule(model, keep_grad_sample=False, lean_forwards=True)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    return psm


def test_forwards_of_a_kind_run_lean_once_two_followed_ones_were_alike() -> None:
    """The first two forwards of a kind are followed, the later ones lean (the tests below would not draw a
    lean forward otherwise); a new kind (other shapes) is followed again; every step exact."""
    model = Branchy()
    psm = wrapped(model)
    lean = []
    for step, t in enumerate([4, 4, 4, 4, 5, 5, 5, 4]):
        x, y = data(4, t, seed=step)
        step_and_check(psm, model, x, y, f"step {step}")
        lean.append(psm._hooks.followed.lean)
    assert lean == [False, False, True, True, False, False, True, True]


@pytest.mark.parametrize("t", [4, 5])  # T == B and T != B
def test_a_branch_adding_a_layer_on_the_batch_is_answered_without_following(t: int) -> None:
    """A lean forward that calls a layer the followed ones did not (on the batch, with a residual add after it)
    is answered from the calls themselves, exact; the kind is followed from then on."""
    model = Branchy(t=t)
    psm = wrapped(model)
    for step in range(8):
        model.mode = "extra" if step >= 4 else "plain"
        x, y = data(4, t, seed=step)
        step_and_check(psm, model, x, y, f"step {step}")
        if step >= 5:
            assert not psm._hooks.followed.lean, f"step {step}: the kind is followed after its unmatched forward"


@pytest.mark.parametrize("t", [4, 5])
@pytest.mark.parametrize("mode", ["transpose", "shared"])
def test_a_branch_that_moves_or_shares_the_batch_is_refused_once_then_followed(mode: str, t: int) -> None:
    """A lean forward whose layer call gets the batch moved to another dim (``transpose``), or an input every
    sample shares (``shared``: with T == B of the batch's size), cannot be answered without following its
    ops: refused, with ``.grad`` untouched; the step run again is followed, exact, and so are the later ones."""
    model = Branchy(t=t)
    psm = wrapped(model)
    for step in range(4):
        x, y = data(4, t, seed=step)
        step_and_check(psm, model, x, y, f"step {step}")
    model.mode = mode
    x, y = data(4, t, seed=4)
    before = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    with pytest.raises(BatchSizeError, match=UNMATCHED):
        loss_fn(psm(x), y).backward()
    for n, p in model.named_parameters():
        same = p.grad is None if before[n] is None else p.grad is not None and torch.equal(p.grad, before[n])
        assert same, f"{n}: .grad changed by the refused forward"
    for step in range(4, 8):
        x, y = data(4, t, seed=step)
        step_and_check(psm, model, x, y, f"step {step} ({mode})")


class LayerDrop(nn.Module):
    """Residual blocks, each skipped at random in training (fairseq's LayerDrop)."""

    def __init__(self, d: int = 4, blocks: int = 4, p: float = 0.5) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(blocks))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 3)
        self.p, self.rng, self.skip = p, random.Random(0), [False] * blocks

    def draw(self) -> None:
        self.skip = [self.rng.random() < self.p for _ in self.blocks]

    def forward(self, x: Tensor) -> Tensor:
        for block, skip in zip(self.blocks, self.skip, strict=True):
            if not skip:
                x = x + block(x)
        return self.head(self.norm(x))


@pytest.mark.parametrize("b", [4, 5])
def test_layerdrop_is_exact_at_every_step(b: int) -> None:
    """Blocks skipped at random (drawn once per step, the reference skipping the same): every step exact."""
    model = LayerDrop()
    psm = wrapped(model)
    gen = torch.Generator().manual_seed(3)
    for step in range(14):
        model.draw() if step >= 3 else None
        x, y = torch.randn(b, 4, generator=gen), torch.randint(0, 3, (b,), generator=gen)
        step_and_check(psm, model, x, y, f"step {step} (skip {model.skip})")


def test_sequence_lengths_that_change_every_step_and_more_kinds_than_remembered() -> None:
    """Dynamic padding: T changes every step (on both sides of B), more kinds than ``KINDS``, and the first
    ones again; eval-mode forwards between (another kind): every training step exact."""
    model = Branchy()
    psm = wrapped(model)
    lengths = [3, 4, 5, 4, 3, 5, 4, 4, *range(6, 72), 3, 4, 5, 4, 4]
    for step, t in enumerate(lengths):
        x, y = data(4, t, seed=step)
        if step % 5 == 4:
            model.eval()
            with torch.no_grad():
                psm(x)
            model.train()
        if t > 8 and t % 9:  # keep the run short: the long tail only fills the records
            model.zero_grad(set_to_none=True)
            loss_fn(psm(x), y).backward()
            continue
        step_and_check(psm, model, x, y, f"step {step} (T={t})")


def test_a_user_hook_added_and_removed_while_forwards_run_lean() -> None:
    """A forward hook of the user's that rescales a layer's output, registered once the forwards run lean, and
    removed later: each change is a new path, answered or followed, exact at every step, T == B."""
    model = Branchy(t=4)
    psm = wrapped(model)
    handle = None
    for step in range(10):
        if step == 3:
            handle = model.inp.register_forward_hook(lambda m, a, out: out * 1.5)
        if step == 6:
            assert handle is not None
            handle.remove()
        x, y = data(4, 4, seed=step)
        step_and_check(psm, model, x, y, f"step {step}")


def test_requires_grad_switched_while_lean_follows_the_new_layers() -> None:
    """Freezing a layer once forwards run lean wraps the model again (new records), exact before and after."""
    model = Branchy(t=4)
    psm = wrapped(model)
    for step in range(8):
        if step == 4:
            model.inp.requires_grad_(False)
        x, y = data(4, 4, seed=step)
        expected = clipped_mean(
            {n: g for n, g in one_at_a_time(model, x, y).items() if dict(model.named_parameters())[n].requires_grad},
            BOUND,
        )
        model.zero_grad(set_to_none=True)
        loss_fn(psm(x), y).backward()
        for n, p in model.named_parameters():
            if not p.requires_grad or p.grad is None:  # (frozen, or not used by this forward)
                assert p.grad is None and (not p.requires_grad or not expected[n].any()), f"step {step}: {n}"
            else:
                assert_close(p.grad, expected[n], f"step {step}: .grad of {n}")


def test_a_batch_of_one_and_of_two_alternating() -> None:
    """B = 1 (every dim of size 1 could be the batch's) alternating with B = 2: exact at every step."""
    model = Branchy(t=4)
    psm = wrapped(model)
    for step in range(10):
        b = 1 if step % 3 else 2
        if step == 6:
            model.mode = "extra"
        x, y = data(b, 4, seed=step)
        step_and_check(psm, model, x, y, f"step {step} (B={b})")


@pytest.mark.parametrize("mode", ["transpose", "shared"])
def test_lean_forwards_off_follows_every_forward(mode: str) -> None:
    """``lean_forwards=False`` (the default): no forward runs lean, and the switch of path that a lean forward
    refuses is followed like any other, exact at every step (T == B)."""
    model = Branchy(t=4)
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    assert not psm.options.lean_forwards
    for step in range(8):
        model.mode = mode if step >= 4 else "plain"
        x, y = data(4, 4, seed=step)
        step_and_check(psm, model, x, y, f"step {step}")
        assert not psm._hooks.followed.lean, f"step {step}: a lean forward with lean_forwards=False"


class AuxOnOddSteps(nn.Module):
    """A frozen layer between a trainable one and the heads, and an auxiliary head used on odd steps only."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.inp, self.frozen = nn.Linear(d, d), nn.Linear(d, d).requires_grad_(False)
        self.head, self.aux = nn.Linear(d, 3), nn.Linear(d, 3)
        self.use_aux = False

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.frozen(torch.tanh(self.inp(x))))
        out = self.head(h) + (self.aux(h) if self.use_aux else 0)
        return out.sum(1)


@pytest.mark.xfail(
    strict=True,
    raises=BatchSizeError,
    reason="false error with lean_forwards=True: two micro-batches per step make a kind lean within a step; the "
    "auxiliary head of the odd steps is then a call no record has, on an input computed through a frozen layer "
    "(not elementwise) with the batch's size on two dims (T == B): refused once (every forward followed is exact)",
)
def test_an_auxiliary_head_on_odd_steps_with_micro_batches() -> None:
    model = AuxOnOddSteps()
    psm = wrapped(model)
    psm.loss_scale = 0.5  # each micro-batch's mean loss halved: the two add up to the batch's mean
    for step in range(4):
        model.use_aux = step % 2 == 1
        x, y = data(8, 4, d=4, seed=step)
        expected = clipped_mean(one_at_a_time(model, x, y), BOUND)
        model.zero_grad(set_to_none=True)
        for half in (slice(0, 4), slice(4, 8)):
            (loss_fn(psm(x[half]), y[half]) / 2).backward()
        for n, p in model.named_parameters():
            if p.requires_grad and p.grad is not None:
                assert_close(p.grad, expected[n], f"step {step}: .grad of {n}")

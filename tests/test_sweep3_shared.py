"""Issue 39, part three, where the batch is: ``torch.compile`` with inputs shared by the batch.

Every step is checked against plain autograd on each sample alone, run on a copy of the model, in
float64, with ``clip_norm(C)`` on the whole model (C: the first step's median per-sample norm) and
``keep_grad_sample`` both ways, over steps with ``T == B`` and ``T != B`` on both sides of 16
positions (where weights start running detached).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pergrad import PerSampleModule, transforms
from tests.reference import assert_close, clipped_mean

STEPS = [(4, 4), (3, 5), (17, 17), (2, 15), (16, 16), (3, 17)]  # (batch, length): T == B on half of them

Batch = Callable[[int, int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def tokens(b: int, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 9, (b, t), generator=gen), torch.randint(0, 9, (b, t), generator=gen)


def features(b: int, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(b, t, 4, generator=gen, dtype=torch.float64)
    return x, torch.randn(b, 3, generator=gen, dtype=torch.float64)


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten(), reduction="sum")


def squared(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).sum()


def one_at_a_time(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Loss, dim: int = 0
) -> dict[str, torch.Tensor]:
    """``{name: [B, *p.shape]}``: plain autograd on each sample's own loss, one sample at a time (the
    batch of ``x`` on ``dim``, of ``y`` on dim 0)."""
    params = dict(model.named_parameters())
    rows = []
    for i in range(y.shape[0]):
        out = model(x.narrow(dim, i, 1))
        grads = torch.autograd.grad(loss(out, y[i : i + 1]), list(params.values()), allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for p, g in zip(params.values(), grads, strict=True)])
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(params)}


def run(
    make: Callable[[], nn.Module],
    batch: Batch,
    loss: Loss,
    wrap: Callable[[PerSampleModule], Callable[[torch.Tensor], torch.Tensor]] | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
    steps: list[tuple[int, int]] = STEPS,
) -> None:
    """Several steps through the wrapper (called through ``wrap(psm)``; ``prepare`` changes the model
    after the reference copy is made): every step's ``grad_sample``, clipped ``.grad`` and norms
    against ``one_at_a_time`` on the copy, with and without ``keep_grad_sample``."""
    for keep in (True, False):
        torch.manual_seed(0)
        model = make().double()
        plain = copy.deepcopy(model)
        if prepare is not None:
            prepare(model)
        gen = torch.Generator().manual_seed(1)
        with PerSampleModule(model, keep_grad_sample=keep, track_norms=True) as psm:
            forward = psm if wrap is None else wrap(psm)
            bound = None
            for step, (b, t) in enumerate(steps):
                x, y = batch(b, t, gen)
                ref = one_at_a_time(plain, x, y, loss)
                norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
                if bound is None:
                    bound = float(norms.median())
                    psm.register_transform(model, transforms.clip_norm(bound))
                want = clipped_mean(ref, bound)
                psm.zero_grad()
                (loss(forward(x), y) / b).backward()
                found = psm.per_sample_norms()
                for name, p in model.named_parameters():
                    what = f"keep={keep}, step {step} (B={b}, T={t}): {name}"
                    if keep:
                        assert_close(p.grad_sample, ref[name], f"grad_sample of {what}")
                    assert_close(p.grad, want[name], f".grad of {what}")
                    assert_close(found[name], ref[name].flatten(1).norm(dim=1), f"norms of {what}")


# -- torch.compile with inputs shared by the batch ------------------------------------------------


class Positions(nn.Module):
    """``pos(torch.arange(T))``: a position embedding whose input is shared by the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(9, 5), nn.Embedding(24, 5), nn.Linear(5, 9)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.tok(idx) + self.pos(torch.arange(idx.shape[1]))))


class Fourier(nn.Module):
    """A Linear on Fourier features built inside the forward, ``sin(arange(T)[:, None] * f)``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.fourier, self.out = nn.Linear(4, 4), nn.Linear(6, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(-torch.arange(6, dtype=x.dtype) / 6)
        waves = torch.sin(torch.arange(x.shape[1], dtype=x.dtype)[:, None] * freqs)  # [T, 6]
        return self.out(torch.tanh(self.inp(x) + self.fourier(waves))).mean(1)


@pytest.fixture
def dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("dynamo")
@pytest.mark.parametrize(("make", "batch", "loss"), [(Positions, tokens, token_loss), (Fourier, features, squared)])
def test_compiled_model_with_inputs_shared_by_the_batch(
    make: Callable[[], nn.Module], batch: Batch, loss: Loss
) -> None:
    """The compiled model's forward runs eagerly under pergrad's tracking: exact from step 0."""
    run(make, batch, loss, wrap=lambda psm: torch.compile(psm, backend="aot_eager"))


@pytest.mark.usefixtures("dynamo")
def test_compiled_model_with_inductor() -> None:
    run(Positions, tokens, token_loss, wrap=lambda psm: torch.compile(psm, backend="inductor"), steps=STEPS[:3])


class CompiledInside(nn.Module):
    """A block compiled on its own (``module.compile()``) after a shared position embedding, and
    Fourier features from a function compiled (and run once) before the model was wrapped."""

    def __init__(self) -> None:
        super().__init__()
        self.pos, self.fourier = nn.Embedding(24, 4), nn.Linear(6, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = x + self.pos(torch.arange(t)) + self.fourier(fourier_features(t, x.dtype))
        return self.block(h).mean(1)


@torch.compile(backend="aot_eager")
def fourier_features(t: int, dtype: torch.dtype) -> torch.Tensor:
    freqs = torch.exp(-torch.arange(6, dtype=dtype) / 6)
    return torch.sin(torch.arange(t, dtype=dtype)[:, None] * freqs)


@pytest.mark.usefixtures("dynamo")
def test_compiled_submodules_and_functions_inside_the_model() -> None:
    fourier_features(4, torch.float64)  # compiled code cached without pergrad's tracking

    def compile_block(model: nn.Module) -> None:
        assert isinstance(model, CompiledInside)
        model.block.compile(backend="aot_eager")

    run(CompiledInside, features, squared, prepare=compile_block)

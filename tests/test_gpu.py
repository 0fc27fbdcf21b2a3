"""What users do on a GPU, every step against each sample's own gradient from plain autograd on a copy.

Skipped without CUDA (CI has none); run on a GPU machine with ``python -m pytest tests/test_gpu.py``. The
models are float64 so that the comparison is exact to round-off, on the GPU's own kernels (and, compiled,
inductor's Triton kernels).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pergrad import PerSampleModule, transforms
from pergrad.privacy import DPSGD, PoissonBatchSampler

DEVICE = os.environ.get("PERGRAD_TEST_DEVICE", "cuda")  # "cpu" checks this file's own harness
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")

C = 0.05
Loss = Callable[[nn.Module, Tensor, Tensor], Tensor]


def classify(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(m(x), y)


def tokens(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(m(x).flatten(0, 1), y.flatten())


def per_sample(model: nn.Module, loss: Loss, x: Tensor, y: Tensor) -> list[list[Tensor]]:
    """Each sample's gradient, one sample at a time, on a copy of the model (no pergrad hooks)."""
    copied = copy.deepcopy(model)
    params = [p for p in copied.parameters() if p.requires_grad]
    return [
        [g.detach() for g in torch.autograd.grad(loss(copied, x[i : i + 1], y[i : i + 1]), params)]
        for i in range(len(x))
    ]


def clipped_sum(grads: list[list[Tensor]], bound: float) -> list[Tensor]:
    out = [torch.zeros_like(g) for g in grads[0]]
    for g in grads:
        factor = min(1.0, bound / math.sqrt(sum(float(t.square().sum()) for t in g)))
        for o, t in zip(out, g):
            o.add_(t, alpha=factor)
    return out


def train_clipped(
    model: nn.Module, loss: Loss, batches: list[tuple[Tensor, Tensor]], forward: Callable[[PerSampleModule], nn.Module]
) -> None:
    """Several SGD steps with ``clip_norm(C)`` on the whole model; each step's ``.grad`` and norms checked."""
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(C))
    net = forward(psm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step, (x, y) in enumerate(batches):
        grads = per_sample(model, loss, x, y)
        expected = [g / len(x) for g in clipped_sum(grads, C)]
        optimizer.zero_grad()
        loss(net, x, y).backward()
        params = [p for p in model.parameters() if p.requires_grad]
        for i, (p, e) in enumerate(zip(params, expected)):
            assert p.grad is not None and p.grad.device.type == DEVICE
            torch.testing.assert_close(p.grad, e, rtol=1e-9, atol=1e-12, msg=f"step {step}, parameter {i}")
        optimizer.step()
    psm.remove()


class Positions(nn.Module):
    """Token and position embeddings (positions shared by the batch: ``pos(arange(T))``), a Linear head."""

    def __init__(self, vocab: int = 11, dim: int = 6, length: int = 8) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(length, dim)
        self.mix, self.head = nn.Linear(dim, dim), nn.Linear(dim, vocab)

    def forward(self, x: Tensor) -> Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        return self.head(torch.tanh(self.mix(h)))


class SeqFirst(nn.Module):
    """Batch-first in and out; seq-first inside (``[T, B, D]`` through a Linear and a seq-first GRU)."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.inner, self.rnn = nn.Linear(dim, dim), nn.GRU(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: Tensor) -> Tensor:
        h = self.tok(x).transpose(0, 1)
        h, _ = self.rnn(torch.tanh(self.inner(h)))
        return self.head(h.transpose(0, 1))


def token_batches(sizes: list[tuple[int, int]], vocab: int = 11) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randint(0, vocab, (b, t), generator=g).to(DEVICE),
            torch.randint(0, vocab, (b, t), generator=g).to(DEVICE),
        )
        for b, t in sizes
    ]


SIZES = [(5, 5), (4, 6), (6, 6), (3, 8)]  # T == B on the first and third steps


def test_a_model_moved_to_the_gpu_after_wrapping_under_dpsgd() -> None:
    """The usual order on a GPU: wrap (and build DPSGD) on the CPU, then ``model.to(DEVICE)``; sigma = 0 so that
    each step's ``.grad`` is exactly ``sum_i clip_C(g_i) / E[B]`` of the step's Poisson batch."""
    torch.manual_seed(0)
    n, q = 40, 0.2
    x = torch.randn(n, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (n,))
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.ReLU(), nn.Linear(7, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = PoissonBatchSampler(n, q, steps=5, generator=torch.Generator().manual_seed(3))
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        dp = DPSGD(psm, optimizer, batches, max_grad_norm=C, noise_multiplier=0.0)
        model.to(DEVICE)
        xc, yc = x.to(DEVICE), y.to(DEVICE)
        for rows in batches:
            optimizer.zero_grad()
            if rows:
                expected = clipped_sum(per_sample(model, classify, xc[rows], yc[rows]), C)
            classify(psm, xc[rows], yc[rows]).backward()
            dp.add_noise()
            for p, e in zip(
                model.parameters(), expected if rows else [torch.zeros_like(p) for p in model.parameters()]
            ):
                assert p.grad is not None and p.grad.device.type == DEVICE
                torch.testing.assert_close(p.grad, e / (q * n), rtol=1e-9, atol=1e-12)
            optimizer.step()
        assert dp.steps == 5


@pytest.mark.parametrize("secure", [False, True], ids=["entropy", "secure"])
def test_the_noise_on_the_gpu_has_std_sigma_c_over_the_expected_batch(secure: bool) -> None:
    torch.manual_seed(0)
    n, q, sigma = 40, 0.25, 2.0
    model = nn.Linear(64, 64).double().to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    batches = PoissonBatchSampler(n, q, steps=20, secure_mode=secure)
    x = torch.randn(n, 64, dtype=torch.float64, device=DEVICE)
    draws = []
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        dp = DPSGD(psm, optimizer, batches, max_grad_norm=C, noise_multiplier=sigma)
        for rows in batches:
            optimizer.zero_grad()
            psm(x[rows]).sum().backward()
            before = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
            dp.add_noise()
            draws += [(p.grad - b).flatten() for p, b in zip(model.parameters(), before)]  # type: ignore[operator]
            optimizer.step()
    noise = torch.cat(draws)
    assert noise.device.type == DEVICE
    std, count = sigma * C / (q * n), noise.numel()
    # the OS's noise: 7 standard errors, a false alarm 3e-12 a statistic (5 of them: 5.7e-7, 2.3e-6 a run of both
    # parameters; 4000 draws of each statistic on the CPU with 1 and 2 threads: worst 3.8 of them)
    assert abs(noise.mean().item()) < 7 * std / math.sqrt(count)
    assert abs(noise.std().item() / std - 1) < 7 / math.sqrt(2 * count)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_with_shared_positions_at_t_equal_to_b(backend: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Positions().double().to(DEVICE)
    train_clipped(model, tokens, token_batches(SIZES), lambda psm: torch.compile(psm, backend=backend))


def test_a_model_that_goes_sequence_first_inside_at_t_equal_to_b() -> None:
    torch.manual_seed(0)
    model = SeqFirst().double().to(DEVICE)
    train_clipped(model, tokens, token_batches(SIZES), lambda psm: psm)


def test_compiled_sequence_first_inside() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SeqFirst().double().to(DEVICE)
    train_clipped(model, tokens, token_batches(SIZES), lambda psm: torch.compile(psm))


def test_grad_sample_of_a_cnn_under_bf16_autocast_is_close_to_plain_autocast() -> None:
    """bf16 autocast (the usual GPU setting): each sample's gradient from pergrad within 2% (of the largest
    entry) of plain autograd's for that sample alone under the same autocast (autocast's own distance from
    float32 is about 7% here)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    model.to(DEVICE)
    x, y = torch.randn(6, 3, 8, 8, device=DEVICE), torch.randint(0, 4, (6,), device=DEVICE)

    def autocast_loss(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = m(x)
        return F.cross_entropy(out.float(), y)

    grads = per_sample(model, autocast_loss, x, y)
    with PerSampleModule(model) as psm:
        autocast_loss(psm, x, y).backward()
        for j, p in enumerate(model.parameters()):
            expected = torch.stack([g[j] for g in grads])
            error = (p.grad_sample.float() - expected).abs().max().item()  # type: ignore[attr-defined]
            assert error < 0.02 * expected.abs().max().item(), j

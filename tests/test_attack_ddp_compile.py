"""Adversarial tests of pergrad under DistributedDataParallel and ``torch.compile`` together, as users write them
(2 gloo processes on CPU, ``tests.test_distributed.Pool``): the orders DDP and compile can come in around the
wrapper, a compiled training step with ``loss.backward()`` and ``optimizer.step()`` inside, ``no_sync``
accumulation, an empty micro-batch on one rank. Batches change shape every step (positions on both sides of 16,
T == B, other batch sizes, unequal across ranks); every rank checks every step's ``.grad`` in float64 against a
one-sample-at-a-time autograd loop over BOTH ranks' samples, on a copy of the model made before anything was
compiled or wrapped, and that both ranks hold the same parameters."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from pergrad import PerSampleModule, transforms
from tests.reference import assert_close, clipped
from tests.test_distributed import Pool

BOUND = 0.3
LR = 0.5
# per step: (positions, rank 0's micro-batch sizes, rank 1's)
STEPS = [(15, (4,), (3,)), (16, (4,), (4,)), (17, (2,), (5,)), (4, (4,), (4,)), (16, (3,), (2,))]
EMPTY = [(15, (3,), (2,)), (16, (0,), (4,)), (17, (2,), (0,)), (4, (4,), (3,))]  # an empty batch on one rank
MICRO = [(15, (2, 3), (3, 1)), (16, (4, 2), (1, 4)), (4, (4, 4), (2, 3)), (17, (1, 2), (3, 3))]  # two per step


@pytest.fixture(scope="module")
def pool2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    pool = Pool(2, tmp_path_factory.mktemp("world2"))
    yield pool
    pool.close()


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def data(step: int, rank: int, micro: int, size: int, positions: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return (
        torch.randn(size, positions, 5, generator=g, dtype=torch.float64),
        torch.randint(0, 3, (size,), generator=g),
    )


def ce(out: Tensor, y: Tensor, reduction: str = "mean") -> Tensor:
    return F.cross_entropy(out.mean(1), y, reduction=reduction)


def one_at_a_time(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """``{name: [B, *shape]}``: each sample's gradient of its own loss by autograd (zeros of ``[0, *shape]`` for
    an empty batch)."""
    grads: dict[str, list[Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        ce(model(x[i : i + 1]), y[i : i + 1]).backward()
        for n, p in model.named_parameters():
            assert p.grad is not None
            grads[n].append(p.grad.clone())
    model.zero_grad(set_to_none=True)
    return {
        n: torch.stack(g) if g else p.new_zeros(0, *p.shape) for (n, g), p in zip(grads.items(), model.parameters())
    }


def expected(
    reference: nn.Module, step: int, plan: tuple[int, tuple[int, ...], tuple[int, ...]], summed: bool
) -> dict[str, Tensor]:
    """The step's ``.grad`` on every rank: summed over micro-batches, of (``summed``) the sum of ``clip(g_i)`` over
    both ranks' samples, or (mean) the mean over ranks of each rank's mean (DDP's reduction)."""
    positions, *sizes = plan
    total = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for rank, micro in enumerate(sizes):
        for m, size in enumerate(micro):
            x, y = data(step, rank, m, size, positions)
            for n, g in clipped(one_at_a_time(reference, x, y), BOUND).items():
                total[n] += g.sum(0) if summed else g.mean(0) / len(sizes)
    return total


def train(rank: int, world: int, order: str, plan: str, backend: str = "aot_eager") -> int:
    """Build the model in ``order``, train the ``plan``'s steps with a compiled training step, check each step."""
    torch._dynamo.reset()
    steps = {"steps": STEPS, "empty": EMPTY, "micro": MICRO}[plan]
    summed = plan == "empty"  # (an empty batch's mean loss is nan: sum losses, sum reduction)
    options: dict[str, Any] = {"loss_reduction": "sum", "reduction": "sum"} if summed else {}
    model = make_model()
    reference = copy.deepcopy(model)
    if order == "psm-of-ddp":  # the documented order: PerSampleModule(DDP(model)), the step calls the wrapper
        ddp = DistributedDataParallel(model)
        psm = PerSampleModule(ddp, **options)
        call: Callable[[Tensor], Tensor] = psm
    elif order == "compiled-ddp":  # PerSampleModule(DDP(model)), the step calls torch.compile(ddp)
        ddp = DistributedDataParallel(model)
        psm = PerSampleModule(ddp, **options)
        call = torch.compile(ddp, backend=backend)
    elif order == "ddp-of-compiled":  # DDP(torch.compile(model)), wrapped
        ddp = DistributedDataParallel(torch.compile(model, backend=backend))
        psm = PerSampleModule(ddp, **options)
        call = ddp
    elif order == "wrapped-then-ddp":  # PerSampleModule(model), then DDP(model): found at the first forward
        psm = PerSampleModule(model, **options)
        ddp = DistributedDataParallel(model)
        call = ddp
    else:
        raise ValueError(order)
    psm.register_transform("", transforms.clip_norm(BOUND))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def backward(x: Tensor, y: Tensor) -> Tensor:
        loss = ce(call(x), y, "sum" if summed else "mean")
        loss.backward()
        return loss.detach()

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad()

    compiled_backward = torch.compile(backward, backend=backend)
    compiled_update = torch.compile(update, backend=backend)
    for step, plan_step in enumerate(steps):
        positions, *sizes = plan_step
        mine = sizes[rank]
        for m, size in enumerate(mine):
            last = m == len(mine) - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                compiled_backward(*data(step, rank, m, size, positions))
        want = expected(reference, step, plan_step, summed)
        for n, p in model.named_parameters():
            assert p.grad is not None, f"rank {rank} step {step}: no .grad of {n}"
            assert_close(p.grad, want[n], f"rank {rank} step {step}: .grad of {n}")
        compiled_update()
        with torch.no_grad():
            for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                assert_close(p, q - LR * want[n], f"rank {rank} step {step}: {n} after the step")
                q.copy_(p)
                others = [torch.empty_like(p) for _ in range(world)]
                dist.all_gather(others, p.detach().contiguous())
                assert all(torch.equal(o, others[0]) for o in others), f"step {step}: the ranks' {n} differ"
    psm.remove()
    return len(steps)


@pytest.mark.parametrize("order", ["psm-of-ddp", "compiled-ddp", "ddp-of-compiled", "wrapped-then-ddp"])
@pytest.mark.parametrize("plan", ["steps", "empty", "micro"])
def test_a_compiled_training_step_under_ddp(pool2: Pool, order: str, plan: str) -> None:
    """A compiled ``forward + loss.backward()`` and a compiled ``optimizer.step()``; ``micro``: two micro-batches
    per step, the first under ``ddp.no_sync()``; ``empty``: a rank with no sample in some steps."""
    assert pool2.run(train, order, plan) == [len({"steps": STEPS, "empty": EMPTY, "micro": MICRO}[plan])] * 2

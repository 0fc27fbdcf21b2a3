"""DistributedDataParallel on CPU (gloo): every rank's .grad is the reduction over ALL ranks' samples."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pergrad import PerSampleModule, transforms
from tests.reference import reference_grad_sample

WORLD, LOCAL_BATCH = 2, 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    n = WORLD * LOCAL_BATCH
    return torch.randn(n, 4, generator=gen, dtype=torch.float64), torch.randn(n, 3, generator=gen, dtype=torch.float64)


def worker(rank: int, init_file: str, out_dir: str, case: str, keep: bool, reduction: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        model = make_model()
        ddp = DistributedDataParallel(model)
        x, target = make_batch()
        mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        with PerSampleModule(ddp, keep_grad_sample=keep, loss_reduction=reduction) as psm:
            if case == "root":
                psm.register_transform(ddp, transforms.clip_norm(0.3))
            elif case == "layer":
                psm.register_transform("module.2", transforms.normalize(1e-6))
            loss = (psm(x[mine]) - target[mine]).pow(2).sum()
            (loss / LOCAL_BATCH if reduction == "mean" else loss).backward()
        torch.save({n: p.grad for n, p in model.named_parameters()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def expected_grads(case: str, reduction: str) -> dict[str, torch.Tensor]:
    model = make_model()
    x, target = make_batch()
    ref = reference_grad_sample(model, x, target)
    covered = {"root": list(ref), "layer": ["2.weight", "2.bias"], "none": []}[case]
    out = {}
    if covered:
        norms = torch.stack([ref[n].flatten(1).square().sum(1) for n in covered]).sum(0).sqrt()
        factor = (0.3 / norms).clamp(max=1) if case == "root" else 1 / (norms + 1e-6)
    for name, g in ref.items():
        if name in covered:
            g = g * factor.view(-1, *([1] * (g.dim() - 1)))
        out[name] = g.mean(0) if reduction == "mean" else g.sum(0)
    return out


@pytest.mark.parametrize(
    ("case", "keep", "reduction"),
    [("root", True, "mean"), ("root", False, "mean"), ("layer", False, "sum"), ("none", True, "sum")],
)
def test_ddp_grads_reduce_over_all_ranks(tmp_path: Path, case: str, keep: bool, reduction: str) -> None:
    mp.spawn(worker, args=(str(tmp_path / "init"), str(tmp_path), case, keep, reduction), nprocs=WORLD, join=True)
    expected = expected_grads(case, reduction)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-10, msg=f"rank {rank} {name}")

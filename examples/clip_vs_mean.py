"""E[T(g_i)] is not T(E[g_i]): per-sample clipping vs clipping the batch gradient.

One batch of 64 samples, one of them an outlier 50 times larger than the others, through a small MLP:
the mean of the per-sample clipped gradients (DP-SGD's) against the clipped mean gradient.

Run: python examples/clip_vs_mean.py [--quick]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from pergrad import PerSampleModule, transforms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the default run: one batch, a second (the tests run it)")
    parser.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(64, 20), torch.randint(0, 4, (64,))
    x[0] *= 50  # one outlier sample dominates the batch gradient

    with PerSampleModule(model) as psm:
        F.cross_entropy(psm(x), y).backward()
        norms = torch.stack([p.grad_sample.flatten(1).norm(dim=1) for p in model.parameters()]).norm(dim=0)
        mean_grad = [p.grad.clone() for p in model.parameters()]
        psm.zero_grad()

        psm.register_transform(model, transforms.clip_norm(1.0))  # DP-SGD's flat clipping
        F.cross_entropy(psm(x), y).backward()
        clipped = [p.grad.clone() for p in model.parameters()]

    flat = torch.cat([g.flatten() for g in mean_grad])
    t_of_e = flat * min(1.0, 1.0 / flat.norm().item())  # T(E[g]): clip the mean gradient
    e_of_t = torch.cat([g.flatten() for g in clipped])  # E[T(g)]: mean of clipped per-sample grads
    print(f"per-sample gradient norms: median {norms.median():.3f}, max {norms.max():.3f} (sample {norms.argmax()})")
    print(f"||T(E[g])|| = {t_of_e.norm():.4f}   ||E[T(g)]|| = {e_of_t.norm():.4f}")
    cos = F.cosine_similarity(t_of_e, e_of_t, dim=0)
    print(f"cosine(T(E[g]), E[T(g)]) = {cos:.4f}: per-sample clipping bounds each sample's influence")


if __name__ == "__main__":
    main()

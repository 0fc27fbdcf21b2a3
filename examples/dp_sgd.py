"""DP-SGD with pergrad: clip every sample's gradient, add Gaussian noise, step any torch optimizer.

One step of DP-SGD (Abadi et al. 2016) on a batch of B samples:

    g~ = (1/B) (sum_i clip_C(g_i) + N(0, sigma^2 C^2 I)),   clip_C(g) = g * min(1, C / ||g||)

pergrad computes ``(1/B) sum_i clip_C(g_i)`` in the ordinary backward (the root target clips the
norm over ALL parameters, without building per-sample gradients); the noise is added to ``.grad``
before ``optimizer.step()``.

Privacy accounting -- turning (sigma, the sampling rate B/N, the number of steps) into an
(epsilon, delta) guarantee -- is out of scope here: use an accountant such as the RDP or PRV
accountants in Opacus (``opacus.accountants``) or Google's ``dp_accounting`` package, and sample
batches with Poisson sampling as the analysis assumes (pergrad handles the empty batches it can
draw).

Run: python examples/dp_sgd.py [--epochs 3] [--sigma 1.0] [--clip 1.0]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from pergrad import PerSampleModule, transforms


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs from ``seed``; labels from one fixed linear teacher shared by train and test."""
    w = torch.randn(20, 3, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 20, generator=torch.Generator().manual_seed(seed))
    return x, (x @ w).argmax(1)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--sigma", type=float, default=1.0, help="noise multiplier")
    parser.add_argument("--clip", type=float, default=1.0, help="clipping bound C")
    parser.add_argument("--rate", type=float, default=0.05, help="Poisson sampling rate B/N")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    x, y = make_data(2000, seed=1)
    x_test, y_test = make_data(500, seed=2)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    expected_batch = args.rate * len(y)
    with PerSampleModule(model, loss_reduction="sum", reduction="sum", keep_grad_sample=False) as psm:
        psm.register_transform(model, transforms.clip_norm(args.clip))
        for _ in range(args.epochs):
            for _ in range(int(1 / args.rate)):
                batch = (torch.rand(len(y)) < args.rate).nonzero().flatten()  # Poisson sampling
                optimizer.zero_grad()
                F.cross_entropy(psm(x[batch]), y[batch], reduction="sum").backward()  # .grad = sum_i clip(g_i)
                for p in model.parameters():
                    if p.grad is None:  # an empty batch reached no parameter
                        p.grad = torch.zeros_like(p)
                    p.grad.add_(torch.randn_like(p) * args.sigma * args.clip)
                    p.grad.div_(expected_batch)  # the DP-SGD estimate divides by the EXPECTED batch size
                optimizer.step()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    print(
        f"DP-SGD: sigma={args.sigma}, C={args.clip}, rate={args.rate}, {args.epochs} epochs -> test accuracy {accuracy:.3f}"
    )
    print("privacy accounting (epsilon, delta) is out of scope: see the docstring")
    return {"accuracy": accuracy}


if __name__ == "__main__":
    main()

"""DP-SGD with pergrad: clip every sample's gradient, add Gaussian noise, step any torch optimizer.

One step of DP-SGD (Abadi et al. 2016) on a batch of B samples:

    g~ = (1/B) (sum_i clip_C(g_i) + N(0, sigma^2 C^2 I)),   clip_C(g) = g * min(1, C / ||g||)

pergrad computes ``(1/B) sum_i clip_C(g_i)`` in the ordinary backward (the root target clips the
norm over ALL parameters, without building per-sample gradients); the noise is added to ``.grad``
before ``optimizer.step()``.

Batches are drawn by Poisson sampling (every sample joins a step's batch with probability
``--rate``), as the privacy analysis assumes; pergrad handles the empty batches it can draw.
Privacy accounting -- turning (sigma, the sampling rate, the number of steps) into the epsilon spent
at ``--delta`` -- is done by Google's ``dp_accounting`` (``pip install dp-accounting``, or the
``examples`` extra): ``steps`` compositions of a ``PoissonSampledDpEvent`` of a ``GaussianDpEvent``,
through its RDP accountant (``--accountant pld`` for the tighter, slower PLD accountant). Without
the package the example still trains and reports epsilon as nan.

Run: python examples/dp_sgd.py [--epochs 3] [--sigma 1.0] [--clip 1.0] [--rate 0.05] [--delta 1e-5]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

from pergrad import PerSampleModule, transforms


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs from ``seed``; labels from one fixed linear teacher shared by train and test."""
    w = torch.randn(20, 3, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 20, generator=torch.Generator().manual_seed(seed))
    return x, (x @ w).argmax(1)


def epsilon(sigma: float, rate: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """Epsilon at ``delta`` of ``steps`` Poisson-sampled Gaussian steps, from Google's ``dp_accounting``."""
    import dp_accounting

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    if accountant == "rdp":
        acc: dp_accounting.PrivacyAccountant = dp_accounting.rdp.RdpAccountant()
    elif accountant == "pld":
        acc = dp_accounting.pld.PLDAccountant()
    else:
        raise ValueError(f"accountant must be 'rdp' or 'pld', got {accountant!r}")
    return float(acc.compose(event).get_epsilon(delta))


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--sigma", type=float, default=1.0, help="noise multiplier")
    parser.add_argument("--clip", type=float, default=1.0, help="clipping bound C")
    parser.add_argument("--rate", type=float, default=0.05, help="Poisson sampling rate B/N")
    parser.add_argument("--delta", type=float, default=1e-5, help="delta of the (epsilon, delta) guarantee")
    parser.add_argument("--accountant", choices=["rdp", "pld"], default="rdp")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    x, y = make_data(2000, seed=1)
    x_test, y_test = make_data(500, seed=2)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    expected_batch = args.rate * len(y)
    steps = args.epochs * int(1 / args.rate)  # what the loops below run
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
    try:
        eps = epsilon(args.sigma, args.rate, steps, args.delta, args.accountant)
    except ModuleNotFoundError as error:
        if error.name != "dp_accounting":
            raise
        eps = math.nan
        print("epsilon needs Google's dp_accounting: pip install dp-accounting")
    print(
        f"DP-SGD: sigma={args.sigma}, C={args.clip}, rate={args.rate}, {args.epochs} epochs ({steps} steps) -> "
        f"test accuracy {accuracy:.3f}, epsilon {eps:.3f} at delta={args.delta} ({args.accountant.upper()})"
    )
    return {"accuracy": accuracy, "epsilon": eps, "steps": steps}


if __name__ == "__main__":
    main()

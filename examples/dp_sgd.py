"""DP-SGD with pergrad: clip every sample's gradient, add Gaussian noise, step any torch optimizer.

One step of DP-SGD (Abadi et al. 2016) on a batch drawn by Poisson sampling:

    g~ = (sum_i clip_C(g_i) + N(0, sigma^2 C^2 I)) / E[B],   clip_C(g) = g * min(1, C / ||g||)

``pergrad.privacy`` does all of it: ``PoissonBatchSampler`` draws the batches (every sample joins a
step's batch with probability ``--rate``, as the privacy analysis assumes; a batch may be empty),
``DPSGD`` registers the clipping (the root target: one norm over ALL parameters, computed in the
ordinary backward without building per-sample gradients) and hooks ``optimizer.step()``, which adds the
noise (divided, as the clipped sum, by the EXPECTED batch size ``rate * N``) and counts the step. ``dp.epsilon(delta)`` is
the epsilon spent, from Google's ``dp_accounting`` (``pip install 'pergrad[dp]'``; in a clone
``pip install -e '.[dp]'`` or the ``examples`` extra): ``steps`` compositions of a ``PoissonSampledDpEvent`` of a ``GaussianDpEvent``, through its
RDP accountant (``--accountant pld`` for the tighter, slower PLD accountant). Without the package
the example still trains and reports epsilon as nan.

Run: python examples/dp_sgd.py [--epochs 3] [--sigma 1.0] [--clip 1.0] [--rate 0.05] [--delta 1e-5] [--quick]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

from pergrad import PerSampleModule
from pergrad.privacy import DPSGD, PoissonBatchSampler

QUICK = {"epochs": 2}  # --quick, what the tests run


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
    parser.add_argument("--delta", type=float, default=1e-5, help="delta of the (epsilon, delta) guarantee")
    parser.add_argument("--accountant", choices=["rdp", "pld"], default="rdp")
    parser.add_argument("--quick", action="store_true", help="2 epochs")
    args = parser.parse_args(argv)
    if args.quick:  # the quick settings, under any option given explicitly
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    torch.manual_seed(0)
    x, y = make_data(2000, seed=1)
    x_test, y_test = make_data(500, seed=2)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    # the batches and the noise come from the operating system's entropy, never from a seed of ours
    sampler = PoissonBatchSampler(len(y), args.rate, steps=int(1 / args.rate))
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        dp = DPSGD(
            psm,
            optimizer,
            sampler,
            max_grad_norm=args.clip,
            noise_multiplier=args.sigma,
            accountant=args.accountant,
        )
        for _ in range(args.epochs):
            for batch in sampler:
                optimizer.zero_grad()
                if batch:  # an empty batch (one process): the step is the noise alone
                    F.cross_entropy(psm(x[batch]), y[batch]).backward()  # .grad = sum_i clip(g_i) / E[B]
                optimizer.step()  # DPSGD adds the noise first and counts the step
        dp.remove()
    steps = dp.steps
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    try:
        eps = dp.epsilon(args.delta)
    except ModuleNotFoundError as error:
        if error.name != "dp_accounting":
            raise
        eps = math.nan
        print(f"epsilon needs Google's dp_accounting: {error}")
    print(
        f"DP-SGD: sigma={args.sigma}, C={args.clip}, rate={args.rate}, {args.epochs} epochs ({steps} steps) -> "
        f"test accuracy {accuracy:.3f}, epsilon {eps:.3f} at delta={args.delta} ({args.accountant.upper()})"
    )
    return {"accuracy": accuracy, "epsilon": eps, "steps": steps}


if __name__ == "__main__":
    main()

"""Gradients with respect to the input and to hidden activations, one per sample.

``d f_i / d x_i`` says how sample i's own loss changes when its input moves: its absolute value is
a saliency map (which pixels matter for this prediction), and its sign is the fast-gradient-sign
direction (Goodfellow et al. 2015): ``x + eps * sign(d f_i / d x_i)`` raises the loss the most, to
first order, among changes of at most eps per pixel. The same gradient for a hidden layer's output
says which of its units the prediction leans on.

pergrad keeps them per sample in one ordinary backward (``keep_activation_grads=True``), scaled
like ``grad_sample``: each sample's own loss, not its share of the batch mean.

Run: python examples/saliency.py [--steps 60] [--eps 0.2] [--lr 0.1] [--seed 0] [--quick]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from pergrad import PerSampleModule


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8x8 images whose class is decided by the brightness of the left vs the right half.

    Pixels are uniform in [0, 0.8], and one half, chosen at random, is brightened by 0.2: the
    halves' means then differ by about 0.2, some 3.5 standard deviations of their noise, so the
    classes are separated by a margin that a short training finds (without it the classes touch and
    the accuracy a short run reaches depends on the seed and on rounding). A step of eps = 0.2 per
    pixel in the right direction moves the difference by up to 0.4 and can flip any sample.
    """
    gen = torch.Generator().manual_seed(seed)
    x = 0.8 * torch.rand(n, 1, 8, 8, generator=gen)
    left = torch.rand(n, generator=gen) < 0.5
    x[left, ..., :4] += 0.2
    x[~left, ..., 4:] += 0.2
    y = (x[..., :4].mean((1, 2, 3)) > x[..., 4:].mean((1, 2, 3))).long()
    return x, y


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eps", type=float, default=0.2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0, help="seeds the initialisation and the data")
    parser.add_argument("--quick", action="store_true", help="the default run: it takes seconds (the tests run it)")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 2))
    x, y = make_data(256, seed=2 * args.seed + 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    for _ in range(args.steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    x_test, y_test = make_data(256, seed=2 * args.seed + 2)
    x_test.requires_grad_(True)  # so the gradient reaches the input
    with PerSampleModule(model, keep_activation_grads=True) as psm:
        F.cross_entropy(psm(x_test), y_test).backward()
        grads = psm.activation_grads()
    saliency = grads["input"].abs().squeeze(1)  # [B, 8, 8]
    left, right = saliency[..., :4].mean().item(), saliency[..., 4:].mean().item()
    hidden = grads["0"]  # d f_i / d (conv output), [B, 8, 8, 8]

    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        adversarial = (x_test + args.eps * grads["input"].sign()).clamp(0, 1)
        adv_accuracy = (model(adversarial).argmax(1) == y_test).float().mean().item()
        clean_loss = F.cross_entropy(model(x_test), y_test).item()
        adv_loss = F.cross_entropy(model(adversarial), y_test).item()
    print(f"test accuracy {accuracy:.2f}; after a fast-gradient-sign step of eps={args.eps}: {adv_accuracy:.2f}")
    print(f"loss {clean_loss:.3f} -> {adv_loss:.3f}")
    print(f"mean saliency: left half {left:.4f}, right half {right:.4f} (every pixel decides, so both matter)")
    print(f"hidden layer '0': per-sample output gradients of shape {tuple(hidden.shape)}")
    return {
        "accuracy": accuracy,
        "adversarial_accuracy": adv_accuracy,
        "clean_loss": clean_loss,
        "adversarial_loss": adv_loss,
    }


if __name__ == "__main__":
    main()
